"""The lightning indexer's per-step row metadata, built once per forward and shared by every layer.

Per query row t: row_kv_off[t], the offset of its request's slots in kv_slots (the request's
kv_start), and row_pos[t], its own position (it sees logical positions 0..row_pos[t]); both come
from tensors the step already has (StepMeta.token_kv_base, ForwardBatch.positions), with no host
sync. max_len bounds every row's context (host int). For prompt chunks (several rows per request
on average) also blocks of up to ROWS_PER_BLOCK consecutive rows of one request that share key
tiles in the logits kernel: (first row int32 [NB], row count int32 [NB], rows per block), built
from the host query_start with numpy.

No Triton here: the model imports this on every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Query rows of one request per prefill logits program (the MMA's N side is this x heads).
ROWS_PER_BLOCK = 4


@dataclass
class IndexerPlan:
    row_kv_off: torch.Tensor  # int32 [T]
    row_pos: torch.Tensor  # int32 [T]
    max_len: int  # >= every row_pos + 1 (sizes the logits)
    blocks: tuple[torch.Tensor, torch.Tensor, int] | None  # prompt-chunk row blocks, or None (a row per program)


def row_blocks_host(query_start, rows_per: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of up to rows_per consecutive rows of one request: (first row, row count), int32."""
    qs = np.asarray(query_start, dtype=np.int64)
    lens = np.diff(qs)
    nb = -(-lens // rows_per)  # blocks per request
    total = int(nb.sum())
    req_first_block = np.cumsum(nb) - nb
    within = np.arange(total, dtype=np.int64) - np.repeat(req_first_block, nb)
    first = np.repeat(qs[:-1], nb) + within * rows_per
    count = np.minimum(rows_per, np.repeat(qs[1:], nb) - first)
    return first.astype(np.int32), count.astype(np.int32)


def wants_blocks(num_rows: int, num_requests: int) -> bool:
    """Prompt chunks (at least 4 rows per request on average) share key tiles in row blocks."""
    return num_rows >= 4 * max(1, num_requests)


def row_blocks(query_start, rows_per: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """row_blocks_host as device tensors, with rows_per: the logits kernel's row_blocks argument."""
    first, count = row_blocks_host(query_start, rows_per)
    dev = lambda a: torch.from_numpy(a).to(device, non_blocking=True)  # noqa: E731
    return dev(first), dev(count), rows_per


def plan_indexer(
    positions: torch.Tensor,  # int [T]
    token_kv_base: torch.Tensor,  # int [T]: kv_start of each row's request
    max_len: int,
    query_start_host: list[int] | None,  # None: no host boundaries (CUDA-graph decode), no row blocks
    rows_per: int | None = None,
) -> IndexerPlan:
    blocks = None
    if query_start_host is not None and wants_blocks(query_start_host[-1], len(query_start_host) - 1):
        blocks = row_blocks(query_start_host, rows_per or ROWS_PER_BLOCK, positions.device)
    return IndexerPlan(
        row_kv_off=token_kv_base.to(torch.int32),
        row_pos=positions.to(torch.int32),
        max_len=max_len,
        blocks=blocks,
    )


def plan_from_host(query_start, cached_lens, seq_lens, device, rows_per: int | None = None) -> IndexerPlan:
    """The same plan from the host lists alone (callers without a StepMeta: tests, benchmarks)."""
    qs = np.asarray(query_start, dtype=np.int64)
    lens = np.diff(qs)
    kv_start = np.concatenate([[0], np.cumsum(np.asarray(seq_lens, dtype=np.int64))])[:-1]
    req = np.repeat(np.arange(len(lens)), lens)
    kv_off = kv_start[req]
    pos = np.asarray(cached_lens, dtype=np.int64)[req] + np.arange(int(qs[-1]), dtype=np.int64) - qs[:-1][req]
    dev = lambda a: torch.from_numpy(a.astype(np.int32)).to(device, non_blocking=True)  # noqa: E731
    blocks = None
    if wants_blocks(int(qs[-1]), len(lens)):
        blocks = row_blocks(query_start, rows_per or ROWS_PER_BLOCK, device)
    return IndexerPlan(row_kv_off=dev(kv_off), row_pos=dev(pos), max_len=max(seq_lens, default=0), blocks=blocks)
