"""The step's work plan for sparse MLA decode: which program runs which part of which row's list.

Under whole_contexts every row's list is its query's whole context (row_len[t] valid entries, then
-1), so rows differ in work by their context lengths. The kernels run one program at a time on a
multiprocessor (a program takes most of its shared memory), and the hardware hands programs out in
launch order. Split the plain way (triton_sparse_mla.plan_splits: every row in the same number of
parts, cut at the same points, programs in row order) such a step ends late: with fewer rows than
multiprocessors a long row's first part is as long as any and a short row's later parts are empty;
with more, the last wave can start long rows late. Simulated on serving's mix (contexts 819-2048,
132 multiprocessors, a part's fixed cost of one block), that plain split ends 1.37-1.9x after the
ideal (all work spread evenly) at 32-256 rows.

The plan cuts every row into parts of one length L (its last part shorter), and lists all parts
longest first, which the hardware's in-order hand-out then schedules greedily (longest processing
time first). L is the multiple of the block that minimises max(L, (entries + parts x PART_COST) /
programs): neither the longest part nor the average load a program can go below that. The same
simulation ends 1.06-1.09x after the ideal at 32-128 rows, 1.2x at 192, 1.06x at 256. A row takes at
most max_parts parts (the partial outputs' buffer is sized by it). Built once a step on the device
(torch ops, no host sync: CUDA graphs capture it) and read by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Entries a part holds at least, in kernel blocks: a part's fixed cost (q into shared memory, the
# pipeline's fill, the partial output's write and merge) stays small against its blocks.
MIN_PART_BLOCKS = 2
# That fixed cost in entries, for the choice of the part length (about one block's time).
PART_COST = 64


@dataclass
class MlaWork:
    """parts: int32 [rows * max_parts, 4], one program each, longest first: (row, part, first
    entry, end entry); row -1 marks a program with nothing to do. counts: int32 [rows], the parts
    of each row (at least 1: a row with no entry still has its output written)."""

    parts: torch.Tensor
    counts: torch.Tensor
    max_parts: int


def max_parts_for(rows: int, programs: int, topk: int, block: int) -> int:
    """The most parts a row may take: 1 from a wave's worth of rows on; else up to about twice the
    even share of the wave, and no part under MIN_PART_BLOCKS blocks of a top-k list. Bounds the
    partial outputs to ~2 programs' worth per multiprocessor whatever the row count."""
    if rows >= programs:
        return 1
    return max(1, min(-(-topk // (MIN_PART_BLOCKS * block)), -(-2 * programs // rows)))


def plan_mla_work(row_len: torch.Tensor, topk: int, programs: int, block: int = 64) -> MlaWork:
    """row_len: int [rows], each row's valid entries (its context, at most topk). programs: how
    many run at once (one a multiprocessor). See the module docstring for the part length."""
    rows = row_len.numel()
    dev = row_len.device
    max_parts = max_parts_for(rows, programs, topk, block)
    n = row_len.to(torch.int64).clamp(0, topk)
    longest = n.max()
    # Candidate part lengths: whole blocks from MIN_PART_BLOCKS up to the top-k, those that keep
    # every row within max_parts.
    cand = torch.arange(MIN_PART_BLOCKS, max(MIN_PART_BLOCKS, -(-topk // block)) + 1, device=dev) * block
    parts_of = ((n[None, :] + cand[:, None] - 1) // cand[:, None]).clamp_min(1)  # [candidates, rows]
    total_parts = parts_of.sum(1)
    load = (n.sum() + PART_COST * total_parts + programs - 1) // programs
    est = torch.maximum(torch.minimum(cand, longest), load)
    est = torch.where(parts_of.max(1).values <= max_parts, est, torch.iinfo(torch.int64).max)
    # The smallest estimate; among equal ones the longest parts (fewer of them). Picked by
    # index_select, not by indexing with a 0-d tensor (which would read it on the host).
    pick = (cand.numel() - 1 - torch.argmin(est.flip(0))).view(1)
    part_len = cand.index_select(0, pick)
    count = parts_of.index_select(0, pick)[0]
    k = torch.arange(max_parts, device=dev)
    first = k[None, :] * part_len
    end = torch.minimum(first + part_len, n[:, None])
    live = k[None, :] < count[:, None]
    length = torch.where(live, end - first, -1).flatten()
    order = torch.sort(length, descending=True, stable=True).indices
    row = torch.where(live, torch.arange(rows, device=dev)[:, None], -1)
    parts = torch.stack([row, k.expand(rows, -1), first.expand(rows, -1), end], dim=-1).reshape(-1, 4)[order]
    return MlaWork(parts.to(torch.int32), count.to(torch.int32), max_parts)
