"""Triton "row_lse_topk" backend: each row's log-sum-exp and its k largest values in one read.

The logprobs of a step that asks for top logprobs need both. torch.topk's radix select reads the
rows several times (0.36 ms of a 256-row decode step at GLM-5's 154,880 on an H200), on top of
the two reads of the "row_logsumexp" kernel. Here each row is read once, by one program or, when
there are too few rows to fill the GPU, by several programs each streaming a piece of it (a second
launch merges the pieces' results):

- log-sum-exp online, per lane: each lane keeps its running max and its sum of exp(x - max),
  rescaled when the max grows; the lanes are combined once at the end;
- top-k: a list of k candidates (value, index) in registers. Each block of the row counts its
  values above the list's smallest (once the list is full) and runs that many rounds (at most
  k), each moving the block's largest remaining value into the list's smallest slot. On random
  rows most blocks after the first few count none.

The list is sorted at the end, largest first; among equal values, which index is reported is
unspecified (as for torch.topk). k up to CANDIDATES; k is a runtime value, so no request's
top_logprobs compiles a variant while serving.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .row_logsumexp import LSE_TOPK_MAX_K

BLOCK = 2048  # values per loop step
CANDIDATES = LSE_TOPK_MAX_K  # the most top values one call returns


@triton.jit
def _largest_left(x, alive, offs, vocab):
    """(largest value among alive in-row lanes, its smallest index; 2^31 - 1 when none is left)."""
    v = tl.where(alive, x, float("-inf"))
    best = tl.max(v, axis=0)
    at = tl.min(tl.where(alive & (v == best) & (offs < vocab), offs, 2147483647), axis=0)
    return best, at


@triton.jit(do_not_specialize=["k", "piece"])
def _row_lse_topk_kernel(
    x_ptr, lse_ptr, val_ptr, idx_ptr, vocab, stride, k, piece,
    KP: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Program (row, p) reads values [p * piece, (p + 1) * piece) of the row. SPLIT: it writes its
    lane-combined (max, sum) to lse_ptr[row, p, 0:2] and its unsorted list (holes and unused
    slots as index -1) to val_ptr / idx_ptr[row, p, :KP] for _merge_kernel; else (one program per
    row) the row's lse and its k values, largest first."""
    row = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    lo = pid * piece
    hi = tl.minimum(lo + piece, vocab)
    base = x_ptr + row * stride
    lanes = tl.arange(0, BLOCK)
    slots = tl.arange(0, KP)
    used = slots < k
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK], tl.float32)
    # Candidate list: slots >= k hold +inf so that the minimum never lands there; empty slots
    # (index -1) hold -inf and are filled before any value is replaced.
    cv = tl.where(used, float("-inf"), float("inf"))
    ci = tl.full([KP], -1, tl.int32)
    # Triton's CPU interpreter loops only over compile-time counts (STEPS and KP there).
    for step in range(STEPS if INTERPRET else tl.cdiv(hi - lo, BLOCK)):
        offs = lo + step * BLOCK + lanes
        inside = offs < hi
        x = tl.load(base + offs, mask=inside, other=float("-inf")).to(tl.float32)
        # Online log-sum-exp per lane; an infinite max shifts by 0 (its sum is not used then).
        new_max = tl.maximum(run_max, x)
        shift = tl.where((new_max == float("inf")) | (new_max == float("-inf")), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.exp(x - shift)
        run_max = new_max
        # Top-k: as many rounds as values could enter the list (all k while it has holes), so a
        # block that cannot change it costs this one count.
        smallest = tl.min(cv, axis=0)
        holes = tl.sum(tl.where(used & (ci < 0), 1, 0), axis=0)
        above = tl.sum(tl.where(inside & (x > smallest), 1, 0), axis=0)
        rounds = tl.where(holes > 0, k, tl.minimum(above, k))
        if rounds > 0:
            alive = inside
            for r in range(KP if INTERPRET else rounds):
                best, at = _largest_left(x, alive, offs, hi)
                alive = alive & (offs != at)
                low = tl.min(cv, axis=0)
                hole = tl.min(tl.where(used & (ci < 0), slots, KP), axis=0)
                slot = tl.where(hole < KP, hole, tl.min(tl.where(cv == low, slots, KP), axis=0))
                take = (at < hi) & ((hole < KP) | (best > low)) & (r < rounds)
                put = (slots == slot) & take
                cv = tl.where(put, best, cv)
                ci = tl.where(put, at, ci)
    m = tl.max(run_max, axis=0)
    infinite = (m == float("inf")) | (m == float("-inf"))
    shift = tl.where(infinite, 0.0, m)
    # Lanes whose max is -inf hold a sum of 0 (exp(-inf) terms): their weight is exp(-inf) = 0.
    total = tl.sum(tl.where(run_max == float("-inf"), 0.0, run_sum * tl.exp(run_max - shift)), axis=0)
    if SPLIT:
        part = row * tl.num_programs(1) + pid
        tl.store(lse_ptr + part * 2, m)
        tl.store(lse_ptr + part * 2 + 1, tl.where(infinite, 1.0, total))
        tl.store(val_ptr + part * KP + slots, cv)
        tl.store(idx_ptr + part * KP + slots, tl.where(used, ci, -1))
    else:
        tl.store(lse_ptr + row, tl.where(infinite, m, shift + tl.log(tl.where(infinite, 1.0, total))))
        _write_sorted(cv, tl.where(used, ci, -1), KP, val_ptr, idx_ptr, row * k, k, INTERPRET)


@triton.jit
def _write_sorted(cv, ci, N: tl.constexpr, val_ptr, idx_ptr, out, k, INTERPRET: tl.constexpr):
    """The k largest of the N entries (value cv, index ci; entries with index -1 left out), largest
    first, to val_ptr / idx_ptr[out : out + k]."""
    at = tl.arange(0, N)
    taken = ci < 0
    for r in range(N if INTERPRET else k):
        v = tl.where(taken, float("-inf"), cv)
        best = tl.max(v, axis=0)
        slot = tl.min(tl.where(~taken & (v == best), at, N), axis=0)
        pick = at == slot
        taken = taken | pick
        if r < k:
            tl.store(val_ptr + out + r, best)
            tl.store(idx_ptr + out + r, tl.sum(tl.where(pick, ci, 0), axis=0).to(tl.int64))


@triton.jit(do_not_specialize=["k", "pieces"])
def _merge_kernel(
    part_lse_ptr, part_val_ptr, part_idx_ptr, lse_ptr, val_ptr, idx_ptr, k, pieces,
    KP: tl.constexpr, PIECES: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Per row: the pieces' (max, sum) into the lse, their lists into the k largest, sorted."""
    row = tl.program_id(0).to(tl.int64)
    pc = tl.arange(0, PIECES)
    ok = pc < pieces
    part = row * pieces + pc
    m = tl.load(part_lse_ptr + part * 2, mask=ok, other=float("-inf"))
    s = tl.load(part_lse_ptr + part * 2 + 1, mask=ok, other=0.0)
    top = tl.max(m, axis=0)
    infinite = (top == float("inf")) | (top == float("-inf"))
    shift = tl.where(infinite, 0.0, top)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - shift)), axis=0)
    tl.store(lse_ptr + row, tl.where(infinite, top, shift + tl.log(tl.where(infinite, 1.0, total))))
    e = (row * pieces) * KP + tl.arange(0, PIECES * KP)
    inside = tl.arange(0, PIECES * KP) < pieces * KP
    cv = tl.load(part_val_ptr + e, mask=inside, other=float("-inf"))
    ci = tl.load(part_idx_ptr + e, mask=inside, other=-1)
    _write_sorted(cv, ci, PIECES * KP, val_ptr, idx_ptr, row * k, k, INTERPRET)


# Programs per row: a few hundred rows fill the GPU one program each; fewer rows split each row
# into pieces of at least MIN_PIECE values (then one more launch merges them).
PROGRAMS_WANTED = 264  # two per multiprocessor of an H100/H200
MIN_PIECE = 8192
MAX_PIECES = 16


def row_lse_topk_triton(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The registry's ("row_lse_topk", "triton") backend: same arguments and results as
    row_lse_topk_torch."""
    rows, vocab = x.shape
    if not 0 < k <= min(CANDIDATES, vocab):
        raise ValueError(f"row_lse_topk_triton takes 1 <= k <= {min(CANDIDATES, vocab)}, got {k}")
    lse = torch.empty(rows, dtype=torch.float32, device=x.device)
    vals = torch.empty(rows, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=x.device)
    if rows == 0:
        return lse, vals, ids
    x = x if x.stride(1) == 1 else x.contiguous()
    interp = x.device.type != "cuda"
    pieces = max(1, min(MAX_PIECES, PROGRAMS_WANTED // rows, vocab // MIN_PIECE))
    if interp:  # the interpreter's tests reach the split path at their small sizes
        pieces = max(1, min(MAX_PIECES, PROGRAMS_WANTED // rows, triton.cdiv(vocab, 2 * BLOCK)))
    piece = triton.cdiv(vocab, pieces)
    steps = triton.cdiv(piece, BLOCK) if interp else 0
    if pieces == 1:
        _row_lse_topk_kernel[(rows, 1)](
            x, lse, vals, ids, vocab, x.stride(0), k, piece,
            KP=CANDIDATES, BLOCK=BLOCK, STEPS=steps, SPLIT=False, INTERPRET=interp, num_warps=8,
        )  # fmt: skip
        return lse, vals, ids
    part_lse = torch.empty(rows, pieces, 2, dtype=torch.float32, device=x.device)
    part_val = torch.empty(rows, pieces, CANDIDATES, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(rows, pieces, CANDIDATES, dtype=torch.int32, device=x.device)
    _row_lse_topk_kernel[(rows, pieces)](
        x, part_lse, part_val, part_idx, vocab, x.stride(0), k, piece,
        KP=CANDIDATES, BLOCK=BLOCK, STEPS=steps, SPLIT=True, INTERPRET=interp, num_warps=8,
    )  # fmt: skip
    _merge_kernel[(rows,)](
        part_lse, part_val, part_idx, lse, vals, ids, k, pieces,
        KP=CANDIDATES, PIECES=MAX_PIECES, INTERPRET=interp, num_warps=4,
    )  # fmt: skip
    return lse, vals, ids
