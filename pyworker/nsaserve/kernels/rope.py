"""Rotary position embedding in the two layouts this model family uses.

- interleaved (GPT-J): dims (2i, 2i+1) form pair i. DeepSeek's MLA and GLM-5's indexer. The output
  keeps the interleaved layout (what FlashMLA-style caches store); transformers instead returns
  [rotated evens | rotated odds], which permutes q and k alike and leaves every dot product equal.
- half-split (NeoX): dims (i, i + d/2) form pair i. DeepSeek-V3.2's indexer.

`cos`/`sin` are [T, d/2] (one angle per pair), already multiplied by the YaRN attention factor.
"""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0):
    """cos/sin tables [T, d/2] in float32 for absolute positions."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(device=positions.device, dtype=torch.float32)[None, :]
    if attention_factor == 1.0:  # x * 1.0 == x: two launches fewer per step
        return angles.cos(), angles.sin()
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def _bcast(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # cos/sin are per token [T, d/2]; x is [T, d] or [T, heads, d].
    return t.view(t.shape[0], *([1] * (x.dim() - 2)), t.shape[1])


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    c, s = _bcast(cos, x), _bcast(sin, x)
    even, odd = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return out.to(x.dtype)


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    c, s = _bcast(cos, x), _bcast(sin, x)
    half = x.shape[-1] // 2
    first, second = xf[..., :half], xf[..., half:]
    return torch.cat((first * c - second * s, second * c + first * s), dim=-1).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return apply_rope_interleaved(x, cos, sin) if interleaved else apply_rope_neox(x, cos, sin)
