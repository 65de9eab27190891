"""The step's row order for sparse MLA: rows launched longest first, each with its count of entries.

A row's list holds min(position + 1, width) valid entries, then -1: a query sees at most its own
causal context, and both the indexer's top-k and a whole context put the valid entries first.
The rows of a serving step differ in context, and the attention kernels run one program a
multiprocessor, handed out by the hardware in launch order. In the plan's row order a step of
more rows than multiprocessors can start a long row in its last wave and end late: on
the H200, 256 rows spread over 819-2048 tokens took 235 us a layer against ~180 us for 256 rows
of 1,400 (bench/results/2026-12-05-sparse-mla-spread.md, 2026-12-05-step-profile-mla-work-plan.md).
Launched longest first, the hardware's in-order hand-out schedules greedily (longest processing
time first): simulated on 132 multiprocessors, serving's mix ends 1.04x after the ideal at 256
rows where a shuffled row order ends 1.36x after it (1.05x / 1.25x at 384). (The router lists
running requests oldest first, often near longest first at a steady concurrency; new requests,
resumed ones and data-parallel ranks' rows break that order.)

Unlike the work plan (mla_work.py) no row is cut into parts: each program runs what it ran
before, for another row, with its loop ending at the row's count (no scan of the list for its
last valid entry). Built once a step on the device (no host sync: CUDA graphs capture it) and
read by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowOrder:
    """rows: int32 [T, 2], one entry a program in launch order: (row, its valid entries), the
    rows with the most entries first (ties in row order)."""

    rows: torch.Tensor


def row_lengths(row_pos: torch.Tensor, width: int) -> torch.Tensor:
    """Valid entries of each row's list: its causal context (position + 1), at most the width."""
    return (row_pos.to(torch.int32) + 1).clamp(0, width)


def plan_row_order(row_pos: torch.Tensor, width: int) -> RowOrder:
    """row_pos: int [T], each row's position; width: the lists' width (the top-k, or a whole
    context's bucket)."""
    lens = row_lengths(row_pos, width)
    order = torch.sort(lens, descending=True, stable=True).indices
    return RowOrder(torch.stack([order.to(torch.int32), lens[order]], dim=1).contiguous())
