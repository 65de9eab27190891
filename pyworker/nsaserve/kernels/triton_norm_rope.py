"""Triton RMSNorm (optionally fused with the residual add) and RoPE, one launch each.

Same functions as small_ops' torch references, which take several launches and float32
temporaries each (upcast, square, mean, rsqrt, multiply, cast; for RoPE strided slices, stack and
flatten). Rounding follows the references: the normalised value is cast to the input dtype before
the weight multiply, the residual sum is rounded to the input dtype before it is normalised, and
RoPE computes in float32 and rounds once. Device-only (no host sync): safe inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import times_hadamard
from .triton_rounding import cast


@triton.jit
def _rmsnorm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, n_cols, x_stride, r_stride, eps,
    BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if RESIDUAL:
        r = tl.load(r_ptr + row * r_stride + offs, mask=mask, other=0.0)
        x = cast(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty, INTERPRET)
        tl.store(s_ptr + row * n_cols + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(tl.sum(xf * xf, axis=0), n_cols.to(tl.float32)) + eps))
    y = cast(xf * inv, x_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + offs, cast(y * w, y_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, heads, x_stride_t, x_stride_h, cs_stride,
    HALF: tl.constexpr, REST: tl.constexpr, BLOCK_REST: tl.constexpr, BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Rotates dims [0, 2 HALF) of each head row and copies the REST dims after them."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < heads
    i = tl.arange(0, HALF)
    c = tl.load(cos_ptr + t * cs_stride + i)[None, :]
    s = tl.load(sin_ptr + t * cs_stride + i)[None, :]
    src = x_ptr + t * x_stride_t + offs_h[:, None].to(tl.int64) * x_stride_h
    dst = out_ptr + (t * heads + offs_h[:, None]) * (2 * HALF + REST)
    dtype = out_ptr.dtype.element_ty
    if INTERLEAVED:
        # Pair i = dims (2i, 2i+1): load the rows whole and split the pairs in registers (two
        # stride-2 loads ran 14x slower on an H200 than this layout's contiguous halves).
        d = tl.arange(0, 2 * HALF)
        x = tl.load(src + d[None, :], mask=hmask[:, None]).to(tl.float32)
        a, b = tl.split(tl.reshape(x, [BLOCK_H, HALF, 2]))
        ra = cast(a * c - b * s, dtype, INTERPRET)
        rb = cast(b * c + a * s, dtype, INTERPRET)
        tl.store(dst + d[None, :], tl.reshape(tl.join(ra, rb), [BLOCK_H, 2 * HALF]), mask=hmask[:, None])
    else:  # pair i = dims (i, i + d/2): two contiguous halves
        a = tl.load(src + i[None, :], mask=hmask[:, None]).to(tl.float32)
        b = tl.load(src + HALF + i[None, :], mask=hmask[:, None]).to(tl.float32)
        tl.store(dst + i[None, :], cast(a * c - b * s, dtype, INTERPRET), mask=hmask[:, None])
        tl.store(dst + HALF + i[None, :], cast(b * c + a * s, dtype, INTERPRET), mask=hmask[:, None])
    if REST > 0:
        r = 2 * HALF + tl.arange(0, BLOCK_REST)
        rmask = hmask[:, None] & (r < 2 * HALF + REST)[None, :]
        tl.store(dst + r[None, :], tl.load(src + r[None, :], mask=rmask), mask=rmask)


@triton.jit
def _rope_rotate_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, heads, x_stride_t, x_stride_h, cs_stride, rot_scale,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """RoPE of dims [0, 2 HALF) of BLOCK_H head rows of one token (rounded to x's dtype, as the
    rope reference), then the rows times the Hadamard matrix (float32 out, times rot_scale). The
    rows go in three pieces (the rotation pairs' members, the unroped rest), each multiplied into
    the product by an MMA against its rows of the signs; padding lanes hold zeros."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < heads
    dtype = x_ptr.dtype.element_ty
    src = x_ptr + t * x_stride_t + offs_h[:, None].to(tl.int64) * x_stride_h
    i = tl.arange(0, BLOCK_HALF)
    in_half = i < HALF
    if INTERLEAVED:
        dims_a, dims_b = 2 * i, 2 * i + 1
    else:
        dims_a, dims_b = i, HALF + i
    pair_mask = hmask[:, None] & in_half[None, :]
    a = tl.load(src + dims_a[None, :], mask=pair_mask, other=0.0).to(tl.float32)
    b = tl.load(src + dims_b[None, :], mask=pair_mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * cs_stride + i, mask=in_half, other=0.0)[None, :]
    s = tl.load(sin_ptr + t * cs_stride + i, mask=in_half, other=0.0)[None, :]
    ra = cast(a * c - b * s, dtype, INTERPRET).to(tl.float32)
    rb = cast(b * c + a * s, dtype, INTERPRET).to(tl.float32)
    dims_r = 2 * HALF + tl.arange(0, BLOCK_REST)
    rest = tl.load(src + dims_r[None, :], mask=hmask[:, None] & (dims_r < D)[None, :], other=0.0).to(tl.float32)
    offs_d = tl.arange(0, D)
    BF16: tl.constexpr = dtype == tl.bfloat16
    y = times_hadamard(ra, dims_a, offs_d, BF16, INTERPRET) + times_hadamard(rb, dims_b, offs_d, BF16, INTERPRET)
    y += times_hadamard(rest, dims_r, offs_d, BF16, INTERPRET)
    dst = out_ptr + (t * heads + offs_h[:, None]) * D + offs_d[None, :]
    tl.store(dst, y * rot_scale, mask=hmask[:, None])


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """The registry's ("rmsnorm", "triton") backend: same arguments and results as
    small_ops.rmsnorm_torch (y, or (y, x + residual))."""
    n, h = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out_dtype = torch.result_type(weight, x)
    y = torch.empty(n, h, dtype=out_dtype, device=x.device)
    s = None
    if residual is not None:
        if residual.dtype != x.dtype or residual.shape != x.shape:
            raise ValueError(
                f"residual {residual.dtype} {tuple(residual.shape)} must match x {x.dtype} {tuple(x.shape)}"
            )
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        s = torch.empty_like(x, memory_format=torch.contiguous_format)
    if n:
        block = triton.next_power_of_2(h)
        _rmsnorm_kernel[(n,)](
            x, residual if s is not None else x, weight, y, s if s is not None else y, h, x.stride(0),
            residual.stride(0) if s is not None else 0, eps,
            BLOCK=block, RESIDUAL=s is not None, INTERPRET=x.device.type != "cuda", num_warps=max(1, min(16, block // 256)),
        )  # fmt: skip
    return y if s is None else (y, s)


def rope_triton(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, rotate: bool = False
) -> torch.Tensor:
    """The registry's ("rope", "triton") backend: same arguments and result as small_ops.rope_torch
    (x [T, d] or [T, heads, d], possibly a strided slice; the result is contiguous)."""
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(1) if squeeze else x
    tokens, heads, dim = x3.shape
    half = cos.shape[-1]
    if half & (half - 1) or 2 * half > dim:
        raise ValueError(f"the Triton RoPE needs a rotary dim of twice a power of two, at most {dim}; got {2 * half}")
    rest = dim - 2 * half
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    if rotate:
        out = _rope_rotate(x3, cos, sin, interleaved)
        return out.squeeze(1) if squeeze else out
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens:
        block_h = min(triton.next_power_of_2(heads), max(1, 4096 // dim))
        _rope_kernel[(tokens, triton.cdiv(heads, block_h))](
            x3, cos, sin, out, heads, x3.stride(0), x3.stride(1), cos.stride(0),
            HALF=half, REST=rest, BLOCK_REST=triton.next_power_of_2(max(rest, 1)), BLOCK_H=block_h,
            INTERLEAVED=interleaved, INTERPRET=x.device.type != "cuda",
            num_warps=4 if block_h * dim >= 2048 else 1,
        )  # fmt: skip
    return out.squeeze(1) if squeeze else out


def _rope_rotate(x3: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE then the Hadamard rotation of x3 [T, heads, d] -> float32 [T, heads, d], one launch."""
    tokens, heads, dim = x3.shape
    half = cos.shape[-1]
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"the Triton rotation needs a power-of-two head dim of at least 16, got {dim}")
    out = torch.empty(tokens, heads, dim, dtype=torch.float32, device=x3.device)
    if tokens:
        # At least 16 rows, 16 pair members and 16 rest dims per program: the MMA's smallest sides.
        block_h = max(16, min(triton.next_power_of_2(heads), 64))
        _rope_rotate_kernel[(tokens, triton.cdiv(heads, block_h))](
            x3, cos, sin, out, heads, x3.stride(0), x3.stride(1), cos.stride(0), float(dim**-0.5),
            D=dim, HALF=half, BLOCK_HALF=max(16, half), BLOCK_REST=max(16, triton.next_power_of_2(max(dim - 2 * half, 1))),
            BLOCK_H=block_h, INTERLEAVED=interleaved, INTERPRET=x3.device.type != "cuda", num_warps=4,
        )  # fmt: skip
    return out
