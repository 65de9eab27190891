"""Triton "sample_pick" backend: argmax(x + Gumbel(u)) per row in one read of x and u.

Each row is cut into pieces (pieces_for: enough programs to fill the GPU at small batches); a program
keeps, per lane, the largest value seen and its first index, reduces them to its piece's (value,
lowest index), and writes that pair. torch then takes, per row, the first piece holding the row's
largest value: the lowest index overall, as the reference's argmax.

Bit-for-bit with the torch reference (sample_pick.py) on CUDA: the same float32 operations in the
same order, each correctly rounded (log is libdevice's logf, which torch's log calls too), so the
same values and the same token. NaN (only from a broken model) counts as +inf here, where torch's
argmax picks the NaN itself: the two differ only on a row holding both a NaN and an +inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import exact_log

# Values per loop step of a program, and the fewest programs to aim for (two per multiprocessor of
# an H100/H200), with a piece of at least MIN_PIECE values.
BLOCK = 2048
PROGRAMS_WANTED = 264
MIN_PIECE = 8192
_U_MAX = 1.0 - 2.0**-24  # the reference's clamp


@triton.jit
def _sample_pick_kernel(
    x_ptr, u_ptr, greedy_ptr, temp_ptr, th_ptr, val_ptr, idx_ptr, vocab, stride_x, stride_u, piece,
    HAS_GREEDY: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_TH: tl.constexpr, U_MAX: tl.constexpr,
    BLOCK: tl.constexpr, STEPS: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    pieces = tl.num_programs(1)
    lanes = tl.arange(0, BLOCK)
    start = pid * piece
    end = tl.minimum(start + piece, vocab)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = start + lanes  # an all -inf piece answers its first index, as argmax does
    if HAS_GREEDY:
        greedy = tl.load(greedy_ptr + row) != 0
    if HAS_TEMP:
        temp = tl.load(temp_ptr + row)
    if HAS_TH:
        th = tl.load(th_ptr + row)
    # Triton's CPU interpreter loops only over compile-time counts (STEPS there, steps on the GPU).
    for k in range(STEPS if INTERPRET else piece // BLOCK):
        offs = start + k * BLOCK + lanes
        m = offs < end
        x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=float("-inf")).to(tl.float32)
        if HAS_TEMP:
            x = tl.math.div_rn(x, temp)  # correctly rounded, as torch's division (a plain / is not)
        if HAS_TH:
            x = tl.where(x < th, float("-inf"), x)  # the filters' cut, as the reference's masked_fill
        u = tl.load(u_ptr + row * stride_u + offs, mask=m, other=0.5)
        g = -exact_log(-exact_log(tl.minimum(u, U_MAX), INTERPRET), INTERPRET)
        if HAS_GREEDY:
            g = tl.where(greedy, 0.0, g)
        v = g + x
        v = tl.where(v != v, float("inf"), v)  # NaN as +inf (see the module docstring)
        take = v > best  # strict: a lane keeps its first index among equal values
        best_i = tl.where(take, offs, best_i)
        best = tl.where(take, v, best)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_i, 2147483647), axis=0)
    tl.store(val_ptr + row * pieces + pid, top)
    tl.store(idx_ptr + row * pieces + pid, first)


def pieces_for(rows: int, vocab: int) -> int:
    """Pieces per row: enough programs for the GPU, none shorter than MIN_PIECE values."""
    want = max(1, -(-PROGRAMS_WANTED // max(rows, 1)))
    return max(1, min(want, vocab // MIN_PIECE))


def sample_pick_triton(
    x: torch.Tensor,
    u: torch.Tensor,
    greedy: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
) -> torch.Tensor:
    """The registry's ("sample_pick", "triton") backend: same arguments as sample_pick_torch."""
    rows, vocab = x.shape
    if u.shape != x.shape:
        raise ValueError(f"uniforms {tuple(u.shape)} do not match logits {tuple(x.shape)}")
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    u = u if u.stride(1) == 1 else u.contiguous()
    pieces = pieces_for(rows, vocab)
    piece = triton.cdiv(triton.cdiv(vocab, pieces), BLOCK) * BLOCK
    pieces = triton.cdiv(vocab, piece)
    vals = torch.empty(rows, pieces, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, pieces, dtype=torch.int32, device=x.device)
    interp = x.device.type != "cuda"
    g = greedy.view(torch.uint8) if greedy is not None else vals  # not read without HAS_GREEDY
    t = temperature.float().contiguous() if temperature is not None else vals  # not read without HAS_TEMP
    th = threshold.float().contiguous() if threshold is not None else vals  # not read without HAS_TH
    _sample_pick_kernel[(rows, pieces)](
        x, u, g, t, th, vals, idx, vocab, x.stride(0), u.stride(0), piece,
        HAS_GREEDY=greedy is not None, HAS_TEMP=temperature is not None, HAS_TH=threshold is not None,
        U_MAX=_U_MAX, BLOCK=BLOCK,
        STEPS=piece // BLOCK if interp else 0, INTERPRET=interp, num_warps=8,
    )  # fmt: skip
    if pieces == 1:
        return idx[:, 0].long()
    # The first piece holding the row's largest value (pieces ascend in index): argmax's first.
    return idx.gather(1, vals.argmax(dim=1, keepdim=True)).squeeze(1).long()
