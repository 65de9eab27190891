"""Torch references of the small per-layer ops, registered as kernel backends.

Kinds (every backend of a kind takes these arguments and returns this):
    "rmsnorm":         (x [N, H], weight [H], eps, residual=None) -> y, or with a residual
                       (y, s) where s = x + residual is the new residual stream and y = RMSNorm(s)
    "rope":            (x [T, d] or [T, heads, d], cos [T, r/2], sin [T, r/2], interleaved, rotate=False)
                       -> x with its first r <= d dims roped and the rest as they were (r = d for
                       MLA; the indexer ropes the first half of its head dim); rotate: then the
                       Hadamard rotation (hadamard.py), float32 out (the indexer's fp8-cache query)
    "kv_store":        (latent_cache, slots [N], kv [N, R + P], weight [R], eps, cos, sin, interleaved)
                       -> None: kv is kv_a_proj_with_mqa's output; stores RMSNorm(kv[:, :R]) * weight
                       and RoPE(kv[:, R:]) as the MLA latent rows, in place (fp8 rows are quantised;
                       kv_cache_format's layout)
    "index_key_store": (index_k_cache, slots [N], k [N, D], page_size, prep=None) -> None: stores
                       indexer keys in place (fp8: DeepGEMM's paged layout, one scale per key);
                       with prep (an IndexKeyPrep), k is wk's output and is first normalised, roped
                       and (fp8) rotated as the indexer does (index_key_prep_torch)
    "silu_mul":        (h [T, 2n]: a gated MLP's gate, then up) -> silu(gate) * up [T, n]

The torch functions are the definitions (kernels.norms, kernels.rope, kernels.kv_cache_format);
fused GPU versions live in triton_norm_rope.py, triton_kv_store.py and triton_silu_mul.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import kv_cache_format as fmt
from .hadamard import hadamard_rotate
from .norms import layer_norm, rms_norm
from .registry import register
from .rope import apply_rope


@register("rmsnorm", "torch")
def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    if residual is None:
        return rms_norm(x, weight, eps)
    s = x + residual
    return rms_norm(s, weight, eps), s


@register("rope", "torch")
def rope_torch(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, rotate: bool = False
) -> torch.Tensor:
    rot = 2 * cos.shape[-1]
    if rot == x.shape[-1]:
        out = apply_rope(x, cos, sin, interleaved)
    else:
        out = torch.cat((apply_rope(x[..., :rot], cos, sin, interleaved), x[..., rot:]), dim=-1)
    return hadamard_rotate(out) if rotate else out


@register("silu_mul", "torch")
def silu_mul_torch(h: torch.Tensor) -> torch.Tensor:
    n = h.shape[-1] // 2
    return F.silu(h[..., :n]) * h[..., n:]


@register("kv_store", "torch")
def kv_store_torch(cache, slots, kv, weight, eps, cos, sin, interleaved) -> None:
    rank = weight.shape[0]
    c = rms_norm(kv[:, :rank], weight, eps)
    fmt.write_latent(cache, slots, c, apply_rope(kv[:, rank:], cos, sin, interleaved))


class IndexKeyPrep(NamedTuple):
    """What the indexer does to a key between wk and the cache: LayerNorm (weight, bias, eps) in
    float32 rounded to k's dtype; RoPE of the first 2 * cos.shape[1] dims (rounded again); then, if
    rotate (the fp8 caches), the Hadamard rotation in float32 before the quantiser sees it."""

    weight: torch.Tensor
    bias: torch.Tensor
    eps: float
    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool
    rotate: bool


def index_key_prep_torch(k: torch.Tensor, prep: IndexKeyPrep) -> torch.Tensor:
    """The key the cache stores, from wk's output k [N, D] (the definition the fused stores match)."""
    k = layer_norm(k, prep.weight, prep.bias, prep.eps)
    return rope_torch(k, prep.cos, prep.sin, prep.interleaved, rotate=prep.rotate)


@register("index_key_store", "torch")
def index_key_store_torch(
    cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, page_size: int, prep: IndexKeyPrep | None = None
) -> None:
    if prep is not None:
        k = index_key_prep_torch(k, prep)
    fmt.write_index_k(cache, slots, k, page_size)
