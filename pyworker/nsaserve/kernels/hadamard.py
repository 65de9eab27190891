"""Orthonormal Walsh-Hadamard rotation (DeepSeek-V3.2's `rotate_activation` for indexer q and k).

Rotating both sides by the same orthonormal matrix leaves every dot product unchanged, but spreads
a vector's outliers over all its dims, so per-vector fp8 quantisation loses less.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def _hadamard(dim: int, device_str: str) -> torch.Tensor:
    if dim <= 0 or dim & (dim - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two dim, got {dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:  # Sylvester construction: [[H, H], [H, -H]]
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h * dim**-0.5).to(device_str)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> x H (float32), H the orthonormal Sylvester-Hadamard matrix of size D."""
    return x.float() @ _hadamard(x.shape[-1], str(x.device))
