"""FP8 weights with 128x128 block scales, as in the DeepSeek-V3 / V3.2 and GLM FP8 releases.

Per quantised Linear with weight W [N out, K in]:

    weight            float8_e4m3fn  [N, K]
    weight_scale_inv  float32        [ceil(N / 128), ceil(K / 128)]

    W[n, k] = float(weight[n, k]) * weight_scale_inv[n // 128, k // 128]

Edge blocks may be partial (N or K not a multiple of 128); their scale covers only the real
elements. Despite its name ``weight_scale_inv`` multiplies. Quantisation picks amax(block) / 448.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .fp8 import fp8_scale_from_amax, to_e4m3

FP8_BLOCK = 128


class Fp8BlockWeight(NamedTuple):
    """The two tensors of one block-FP8 weight, named as in the checkpoint (unpacks like a tuple)."""

    weight: torch.Tensor  # float8_e4m3fn [..., N, K]
    weight_scale_inv: torch.Tensor  # float32 [..., ceil(N/128), ceil(K/128)]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def quantize_fp8_block(weight: torch.Tensor, scale_fmt: str = "float") -> Fp8BlockWeight:
    """Quantise a float weight [..., N, K] to e4m3 with one scale per 128x128 block."""
    n, k = weight.shape[-2:]
    nb, kb = _ceil_div(n, FP8_BLOCK), _ceil_div(k, FP8_BLOCK)
    # Zero padding up to whole blocks does not change any block's amax.
    padded = F.pad(weight.detach().float(), (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n))
    blocks = padded.reshape(*weight.shape[:-2], nb, FP8_BLOCK, kb, FP8_BLOCK)
    scale = fp8_scale_from_amax(blocks.abs().amax(dim=(-3, -1)), scale_fmt)
    q = to_e4m3(blocks, scale.unsqueeze(-1).unsqueeze(-3))
    q = q.reshape(padded.shape)[..., :n, :k].contiguous()
    return Fp8BlockWeight(q, scale)


def expand_block_scales(weight_scale_inv: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Block scales [..., ceil(N/128), ceil(K/128)] to one scale per element [..., N, K]."""
    per_row = weight_scale_inv.repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :]
    return per_row.repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]


def dequantize_fp8_block(
    weight: torch.Tensor, weight_scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Reference dequantisation of a block-FP8 weight to ``dtype``."""
    n, k = weight.shape[-2:]
    expected = (*weight.shape[:-2], _ceil_div(n, FP8_BLOCK), _ceil_div(k, FP8_BLOCK))
    if tuple(weight_scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv shape {tuple(weight_scale_inv.shape)} does not match weight (expected {expected})"
        )
    return (weight.float() * expand_block_scales(weight_scale_inv.float(), n, k)).to(dtype)


def fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Reference Linear with a block-FP8 weight: float32 accumulation, result in x's dtype."""
    w = dequantize_fp8_block(weight, weight_scale_inv, torch.float32)
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w, b).to(x.dtype)
