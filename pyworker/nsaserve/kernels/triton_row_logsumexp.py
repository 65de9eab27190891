"""Triton "row_logsumexp" backend: one program per row, two reads of the row in its own dtype.

Pass 1 takes the row's max; pass 2 sums exp(x - max) in float32 per lane, then across lanes. The
result is max + log(sum) (torch's own logsumexp does the same, summing in another order, so the
two agree to float32 rounding, not bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _row_logsumexp_kernel(
    x_ptr, out_ptr, vocab, stride, BLOCK: tl.constexpr, STEPS: tl.constexpr, INTERPRET: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    # Triton's CPU interpreter loops only over compile-time counts (STEPS there, on the GPU the vocab's).
    for k in range(STEPS if INTERPRET else tl.cdiv(vocab, BLOCK)):
        offs = k * BLOCK + lanes
        best = tl.maximum(best, tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32))
    m = tl.max(best, axis=0)
    # An infinite max (+inf, or a row of -inf) is the answer itself: exp(x - m) would be NaN there,
    # so the sum shifts by 0 instead and its result is not used.
    infinite = (m == float("inf")) | (m == float("-inf"))
    shift = tl.where(infinite, 0.0, m)
    acc = tl.zeros([BLOCK], tl.float32)
    for k in range(STEPS if INTERPRET else tl.cdiv(vocab, BLOCK)):
        offs = k * BLOCK + lanes
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        acc += tl.exp(x - shift)
    # With a finite max the sum is at least 1 (the max's own term).
    lse = tl.where(infinite, m, shift + tl.log(tl.where(infinite, 1.0, tl.sum(acc, axis=0))))
    tl.store(out_ptr + row, lse)


def row_logsumexp_triton(x: torch.Tensor) -> torch.Tensor:
    """The registry's ("row_logsumexp", "triton") backend: same arguments as row_logsumexp_torch."""
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    interp = x.device.type != "cuda"
    steps = triton.cdiv(vocab, BLOCK)
    _row_logsumexp_kernel[(rows,)](
        x, out, vocab, x.stride(0), BLOCK=BLOCK, STEPS=steps if interp else 0, INTERPRET=interp, num_warps=8
    )
    return out
