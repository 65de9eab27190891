"""Triton KV-cache stores: the MLA latent row and the indexer key, quantised to FP8 on the way in.

One program per token: it reads the token's values once, computes each group's scale, and writes
codes, scales (and, for the latent, the bf16 k_pe) straight to the token's slot, where the torch
references (kv_cache_format.write_latent / write_index_k) take several launches and temporaries.
The model's latent store also applies kv_a_layernorm to the latent and RoPE to k_pe on the way
(three ops of the reference in one launch), and its indexer-key store the key's LayerNorm, RoPE and
(fp8) Hadamard rotation (small_ops.IndexKeyPrep: nine launches of the reference a layer, one here).
Layouts are kv_cache_format's (and, with scale_fmt="ue8m0" and R = 512, P = 64, D = 128,
kernels.quant's 656-byte MLA row and 132-byte paged indexer key):

- latent, fp8: row of R e4m3 codes | R/G float32 scales | P bfloat16 k_pe; model dtype: c | k_pe.
- indexer key, fp8: page p = page_size rows of D codes, then page_size float32 scales; model
  dtype: [slots, D].

Device-only (no host sync): safe inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_cache_format import latent_group
from .small_ops import IndexKeyPrep
from .triton_common import hadamard_signs
from .triton_rounding import cast, quantize_groups, scale_code


@triton.jit
def _latent_store_kernel(
    c_ptr, pe_ptr, slots_ptr, cache_ptr, cache_f32_ptr, cache_bf16_ptr, c_stride, pe_stride,
    w_ptr, cos_ptr, sin_ptr, cs_stride, eps,
    R: tl.constexpr, P: tl.constexpr, G: tl.constexpr, ROW: tl.constexpr,
    FP8: tl.constexpr, SCALE_FMT: tl.constexpr, FUSED: tl.constexpr, INTERLEAVED: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """FUSED: c <- RMSNorm(c) * w and k_pe <- RoPE(k_pe) first, rounded as small_ops' references."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs_r = tl.arange(0, R)
    i = tl.arange(0, P // 2)
    x_dtype = c_ptr.dtype.element_ty
    c = tl.load(c_ptr + t * c_stride + offs_r).to(tl.float32)
    a, b = _load_pairs(pe_ptr + t * pe_stride, P, INTERLEAVED)
    if FUSED:
        inv = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(tl.sum(c * c, axis=0), R * 1.0) + eps))
        w = tl.load(w_ptr + offs_r).to(tl.float32)
        c = cast(cast(c * inv, x_dtype, INTERPRET).to(tl.float32) * w, x_dtype, INTERPRET).to(tl.float32)
        cos = tl.load(cos_ptr + t * cs_stride + i)
        sin = tl.load(sin_ptr + t * cs_stride + i)
        a, b = a * cos - b * sin, b * cos + a * sin
        a = cast(a, x_dtype, INTERPRET).to(tl.float32)
        b = cast(b, x_dtype, INTERPRET).to(tl.float32)
    if FP8:
        codes, scale = quantize_groups(c, R // G, G, SCALE_FMT, INTERPRET)
        tl.store(cache_ptr + slot * ROW + offs_r, codes)
        tl.store(cache_f32_ptr + slot * (ROW // 4) + R // 4 + tl.arange(0, R // G), scale)
        pe_row = cache_bf16_ptr + slot * (ROW // 2) + (R + 4 * (R // G)) // 2
        _store_pairs(pe_row, cast(a, tl.bfloat16, INTERPRET), cast(b, tl.bfloat16, INTERPRET), P, INTERLEAVED)
    else:
        dtype = cache_ptr.dtype.element_ty
        tl.store(cache_ptr + slot * ROW + offs_r, cast(c, dtype, INTERPRET))
        _store_pairs(cache_ptr + slot * ROW + R, cast(a, dtype, INTERPRET), cast(b, dtype, INTERPRET), P, INTERLEAVED)


@triton.jit
def _load_pairs(ptr, P: tl.constexpr, INTERLEAVED: tl.constexpr):
    """A P-vector as the two members (a, b) of its rotation pairs, float32: interleaved pairs are
    dims (2i, 2i+1), split in registers after one contiguous load; else dims (i, i + P/2)."""
    if INTERLEAVED:
        a, b = tl.split(tl.reshape(tl.load(ptr + tl.arange(0, P)).to(tl.float32), [P // 2, 2]))
    else:
        i = tl.arange(0, P // 2)
        a, b = tl.load(ptr + i).to(tl.float32), tl.load(ptr + P // 2 + i).to(tl.float32)
    return a, b


@triton.jit
def _store_pairs(ptr, a, b, P: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The inverse of _load_pairs."""
    if INTERLEAVED:
        tl.store(ptr + tl.arange(0, P), tl.reshape(tl.join(a, b), [P]))
    else:
        i = tl.arange(0, P // 2)
        tl.store(ptr + i, a)
        tl.store(ptr + P // 2 + i, b)


@triton.jit
def _index_k_store_kernel(
    k_ptr, slots_ptr, cache_ptr, cache_f32_ptr, k_stride, page_size,
    D: tl.constexpr, FP8: tl.constexpr, SCALE_FMT: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs = tl.arange(0, D)
    k = tl.load(k_ptr + t * k_stride + offs)
    if FP8:
        page = slot // page_size
        off = slot - page * page_size
        base = page * page_size * (D + 4)
        codes, scale = quantize_groups(k.to(tl.float32), 1, D, SCALE_FMT, INTERPRET)
        tl.store(cache_ptr + base + off * D + offs, codes)
        tl.store(cache_f32_ptr + (base + page_size * D) // 4 + off + tl.arange(0, 1), scale)
    else:
        tl.store(cache_ptr + slot * D + offs, cast(k.to(tl.float32), cache_ptr.dtype.element_ty, INTERPRET))


@triton.jit
def _spread(v, dims, offs_d, ROTATE: tl.constexpr):
    """Contribution of values v at dims to the row's D columns: the unnormalised Hadamard product
    (triton_common.hadamard_signs) if ROTATE, else v placed at its dims."""
    if ROTATE:
        m = hadamard_signs(dims, offs_d)
    else:
        m = (dims[:, None] == offs_d[None, :]).to(tl.float32)
    return tl.sum(v[:, None] * m, axis=0)


@triton.jit
def _layer_norm_at(row_ptr, dims, mask, mean, rstd, w_ptr, b_ptr, x_dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """LayerNorm of the row's elements at dims, rounded to the input dtype (as norms.layer_norm)."""
    x = tl.load(row_ptr + dims, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + dims, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + dims, mask=mask, other=0.0).to(tl.float32)
    return cast((x - mean) * rstd * w + b, x_dtype, INTERPRET).to(tl.float32)


@triton.jit
def _index_k_prep_store_kernel(
    k_ptr, slots_ptr, cache_ptr, cache_f32_ptr, k_stride, page_size,
    w_ptr, b_ptr, cos_ptr, sin_ptr, cs_stride, eps, rot_scale,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_REST: tl.constexpr, FP8: tl.constexpr, ROTATE: tl.constexpr,
    SCALE_FMT: tl.constexpr, INTERLEAVED: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One token: LayerNorm of wk's output row, RoPE of its first 2 HALF dims, the Hadamard rotation
    (ROTATE), then the store (fp8: quantised). The row is handled as three pieces (the rotation
    pairs' first and second members, the unroped rest), which the rotation or the store reassemble."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    row = k_ptr + t * k_stride
    x_dtype = k_ptr.dtype.element_ty
    offs_d = tl.arange(0, D)
    x = tl.load(row + offs_d).to(tl.float32)
    mean = tl.sum(x, axis=0) / D
    xc = x - mean
    rstd = 1.0 / tl.sqrt_rn(tl.sum(xc * xc, axis=0) / D + eps)
    i = tl.arange(0, HALF)
    if INTERLEAVED:
        dims_a, dims_b = 2 * i, 2 * i + 1
    else:
        dims_a, dims_b = i, HALF + i
    whole = i < HALF
    a = _layer_norm_at(row, dims_a, whole, mean, rstd, w_ptr, b_ptr, x_dtype, INTERPRET)
    b = _layer_norm_at(row, dims_b, whole, mean, rstd, w_ptr, b_ptr, x_dtype, INTERPRET)
    cos = tl.load(cos_ptr + t * cs_stride + i)
    sin = tl.load(sin_ptr + t * cs_stride + i)
    ra = cast(a * cos - b * sin, x_dtype, INTERPRET).to(tl.float32)
    rb = cast(b * cos + a * sin, x_dtype, INTERPRET).to(tl.float32)
    dims_r = 2 * HALF + tl.arange(0, BLOCK_REST)
    in_row = dims_r < D
    rest = _layer_norm_at(row, dims_r, in_row, mean, rstd, w_ptr, b_ptr, x_dtype, INTERPRET)
    if FP8 or ROTATE:
        # The whole row in one vector (rotated: every column takes every piece). The rest's padding
        # lanes hold zeros (weight and bias loaded as 0), so they add nothing to any column.
        v = _spread(ra, dims_a, offs_d, ROTATE) + _spread(rb, dims_b, offs_d, ROTATE)
        v += _spread(rest, dims_r, offs_d, ROTATE)
        if ROTATE:
            v = v * rot_scale
        if FP8:
            page = slot // page_size
            off = slot - page * page_size
            base = page * page_size * (D + 4)
            codes, scale = quantize_groups(v, 1, D, SCALE_FMT, INTERPRET)
            tl.store(cache_ptr + base + off * D + offs_d, codes)
            tl.store(cache_f32_ptr + (base + page_size * D) // 4 + off + tl.arange(0, 1), scale)
        else:
            tl.store(cache_ptr + slot * D + offs_d, cast(v, cache_ptr.dtype.element_ty, INTERPRET))
    else:
        dtype = cache_ptr.dtype.element_ty
        tl.store(cache_ptr + slot * D + dims_a, cast(ra, dtype, INTERPRET))
        tl.store(cache_ptr + slot * D + dims_b, cast(rb, dtype, INTERPRET))
        tl.store(cache_ptr + slot * D + dims_r, cast(rest, dtype, INTERPRET), mask=in_row)


def _pow2(n: int, what: str) -> None:
    if n <= 0 or n & (n - 1):
        raise ValueError(f"the Triton KV store needs {what} to be a power of two, got {n}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Rows may be strided (a slice of a wider projection); elements within a row must not be."""
    return x if x.stride(-1) == 1 else x.contiguous()


def store_latent(
    cache: torch.Tensor, slots: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor, scale_fmt: str = "ue8m0",
    norm: tuple | None = None, rope: tuple | None = None,
) -> None:  # fmt: skip
    """cache[slots] = (c, k_pe) in the cache's layout: fp8 rows for a uint8 cache, else the model dtype.
    The default power-of-two scales are kv_cache_format's (the sparse MLA kernels rely on them).

    norm = (weight, eps) stores RMSNorm(c) * weight instead of c; rope = (cos, sin, interleaved)
    stores RoPE(k_pe) instead of k_pe (both need each other: the model's kv_store does both)."""
    n, rank = c.shape
    rope_dim = k_pe.shape[1]
    if n == 0:
        return
    _pow2(rank, "kv_lora_rank")
    _pow2(rope_dim, "the rope dim")
    if (norm is None) != (rope is None):
        raise ValueError("the fused latent store takes both the norm and the rope, or neither")
    if norm is not None and (norm[0].dtype != c.dtype or k_pe.dtype != c.dtype):
        raise ValueError(f"the fused latent store needs one dtype, got {c.dtype}, {k_pe.dtype}, {norm[0].dtype}")
    fp8 = cache.dtype == torch.uint8
    rows = cache.view(-1, cache.shape[-1])
    row = rows.shape[1]
    group = latent_group(rank)
    if fp8:
        want = rank + 4 * (rank // group) + 2 * rope_dim
        if row != want:
            raise ValueError(f"fp8 latent rows are {want} bytes for R={rank}, P={rope_dim}; cache rows are {row}")
        f32, bf16 = rows.view(torch.float32), rows.view(torch.bfloat16)
    else:
        if row != rank + rope_dim:
            raise ValueError(f"latent rows are R + P = {rank + rope_dim} wide; cache rows are {row}")
        f32 = bf16 = rows
    c, k_pe = _rows(c), _rows(k_pe)
    fused = norm is not None
    if fused:
        (weight, eps), (cos, sin, interleaved) = norm, rope
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
    else:
        weight, eps, cos, sin, interleaved = c, 0.0, c, c, False  # unused
    _latent_store_kernel[(n,)](
        c, k_pe, slots, rows, f32, bf16, c.stride(0), k_pe.stride(0),
        weight, cos, sin, cos.stride(0) if fused else 0, eps,
        R=rank, P=rope_dim, G=group, ROW=row, FP8=fp8, SCALE_FMT=scale_code(scale_fmt), FUSED=fused,
        INTERLEAVED=interleaved, INTERPRET=c.device.type != "cuda", num_warps=4 if rank >= 512 else 1,
    )  # fmt: skip


def store_index_k(
    cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, page_size: int, scale_fmt: str = "cache",
    prep: IndexKeyPrep | None = None,
) -> None:  # fmt: skip
    """Index keys k [N, D] into the fp8 paged layout (uint8 [pages, page_size, D + 4]) or [slots, D].
    prep: k is wk's output, normalised, roped and (prep.rotate) rotated on the way (one launch)."""
    n, dim = k.shape
    if n == 0:
        return
    _pow2(dim, "index_head_dim")
    fp8 = cache.dtype == torch.uint8
    if fp8 and (cache.dim() != 3 or cache.shape[1] != page_size or cache.shape[2] != dim + 4):
        raise ValueError(f"fp8 index-key cache must be [pages, {page_size}, {dim + 4}], got {tuple(cache.shape)}")
    k = _rows(k)
    if prep is not None:
        _store_index_k_prepped(cache, slots, k, page_size, scale_fmt, prep, fp8)
        return
    _index_k_store_kernel[(n,)](
        k, slots, cache, cache.view(torch.float32) if fp8 else cache, k.stride(0), page_size,
        D=dim, FP8=fp8, SCALE_FMT=scale_code(scale_fmt), INTERPRET=k.device.type != "cuda", num_warps=1,
    )  # fmt: skip


def _store_index_k_prepped(cache, slots, k, page_size, scale_fmt, prep: IndexKeyPrep, fp8: bool) -> None:
    n, dim = k.shape
    half = prep.cos.shape[-1]
    _pow2(half, "half the indexer's rope dim")
    if 2 * half > dim:
        raise ValueError(f"the indexer ropes {2 * half} dims of a {dim}-dim key")
    cos, sin = prep.cos.float().contiguous(), prep.sin.float().contiguous()
    _index_k_prep_store_kernel[(n,)](
        k, slots, cache, cache.view(torch.float32) if fp8 else cache, k.stride(0), page_size,
        prep.weight, prep.bias, cos, sin, cos.stride(0), prep.eps, float(dim**-0.5),
        D=dim, HALF=half, BLOCK_REST=triton.next_power_of_2(max(dim - 2 * half, 1)), FP8=fp8,
        ROTATE=bool(prep.rotate), SCALE_FMT=scale_code(scale_fmt), INTERLEAVED=bool(prep.interleaved),
        INTERPRET=k.device.type != "cuda", num_warps=4 if prep.rotate else 1,
    )  # fmt: skip


def kv_store_triton(cache, slots, kv, weight, eps, cos, sin, interleaved) -> None:
    """The registry's ("kv_store", "triton") backend: same arguments as small_ops.kv_store_torch
    (the latent's RMSNorm, k_pe's RoPE and the store in one launch)."""
    rank = weight.shape[0]
    store_latent(cache, slots, kv[:, :rank], kv[:, rank:], norm=(weight, eps), rope=(cos, sin, interleaved))


def index_key_store_triton(cache, slots, k, page_size, prep: IndexKeyPrep | None = None) -> None:
    """The registry's ("index_key_store", "triton") backend: same as small_ops.index_key_store_torch."""
    store_index_k(cache, slots, k, page_size, prep=prep)
