"""Triton SiLU·mul of a gated MLP: out = silu(h[:, :n]) * h[:, n:], one launch.

The torch reference (small_ops.silu_mul_torch) takes two launches and a temporary: silu of the gate
half, then the product. This kernel reads each row's two halves once and writes the product once,
rounding where torch does: silu in float32 (x / (1 + exp(-x)), libdevice's expf and a correctly
rounded division, as torch's CUDA kernel computes it) rounded to the input dtype, then the product
of two 16-bit values (exact in float32) rounded once. So on the GPU it is bit-identical to the
reference. Device-only (no host sync): safe inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import exact_exp
from .triton_rounding import cast

# Columns per program. At GLM-5's dense intermediate (12288) and 256 rows that is 3072 programs,
# plenty to fill the GPU; a shared expert's 2048 columns take two per row.
BLOCK = 1024


@triton.jit
def _silu_mul_kernel(
    h_ptr, out_ptr, n, stride_h, stride_out, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    src = h_ptr + row * stride_h + cols
    g = tl.load(src, mask=mask, other=0.0)
    u = tl.load(src + n, mask=mask, other=0.0)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    gf = g.to(tl.float32)
    silu = cast(tl.math.div_rn(gf, 1.0 + exact_exp(-gf, INTERPRET)), dtype, INTERPRET)
    y = silu.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, cast(y, dtype, INTERPRET), mask=mask)


def silu_mul_triton(h: torch.Tensor) -> torch.Tensor:
    """The registry's ("silu_mul", "triton") backend: same argument and result as
    small_ops.silu_mul_torch."""
    rows, two_n = h.shape
    if two_n % 2:
        raise ValueError(f"silu_mul takes [rows, 2n] (gate, then up); got {two_n} columns")
    if h.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the Triton silu_mul takes bf16 or fp16 rows, not {h.dtype}")
    if h.stride(-1) != 1:
        h = h.contiguous()
    n = two_n // 2
    out = torch.empty(rows, n, dtype=h.dtype, device=h.device)
    if rows and n:
        _silu_mul_kernel[(rows, triton.cdiv(n, BLOCK))](
            h, out, n, h.stride(0), out.stride(0), BLOCK=BLOCK, INTERPRET=h.device.type != "cuda", num_warps=4,
        )  # fmt: skip
    return out
