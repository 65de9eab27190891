"""The lightning indexer with its per-row metadata on the device (graph-safe torch reference).

Same scores, causal rule, tie rule and output as indexer.indexer_topk_torch, but instead of host
lists of request boundaries it takes, per query row t, the offset of its request's slots in
kv_slots (row_kv_off[t]) and its own position (row_pos[t]: the row sees logical positions
0..row_pos[t], at kv_slots[row_kv_off[t] + p]), plus a host bound max_len >= every row_pos + 1.
Nothing here reads device data on the host, so a CUDA graph can capture it with a fixed max_len;
the worker's decode graphs give every request a span of max_len slots.

    -> logical positions int64 [T, min(topk, max_len)], -1 padded, best score first.
"""

from __future__ import annotations

import torch

from .indexer import query_for_cache, select_topk
from .kv_cache_format import gather_index_k
from .registry import register

# Bound on the [rows, heads, keys] float32 score block per chunk (64 Mi elements = 256 MiB).
_CHUNK_ELEMS = 1 << 26


@register("indexer_rows", "torch")
def indexer_topk_rows_torch(
    q: torch.Tensor,  # [T, H, D] float32, roped
    weights: torch.Tensor,  # [T, H] float32
    index_k_cache: torch.Tensor,
    kv_slots: torch.Tensor,  # int64
    row_kv_off: torch.Tensor,  # int [T]
    row_pos: torch.Tensor,  # int [T]
    max_len: int,
    topk: int,
    softmax_scale: float,
    page_size: int,
    query: str = "float32",  # or "fp8": see kernels/indexer.py
) -> torch.Tensor:
    q = query_for_cache(q, index_k_cache, query)
    num_tokens, heads, _ = q.shape
    width = min(topk, max_len)
    out = torch.full((num_tokens, width), -1, dtype=torch.int64, device=q.device)
    if num_tokens == 0 or width == 0:
        return out
    pos = torch.arange(max_len, device=q.device)
    last = kv_slots.numel() - 1
    rows = max(1, _CHUNK_ELEMS // (heads * max_len))
    for r0 in range(0, num_tokens, rows):
        r1 = min(num_tokens, r0 + rows)
        # Positions past a row's own are read from wherever they point (clamped into kv_slots)
        # and masked by select_topk.
        idx = (row_kv_off[r0:r1, None].long() + pos[None, :]).clamp(max=last)
        keys = gather_index_k(index_k_cache, kv_slots[idx].reshape(-1), page_size).view(r1 - r0, max_len, -1)
        s = torch.relu(torch.einsum("thd,tld->thl", q[r0:r1], keys) * softmax_scale)
        scores = torch.einsum("th,thl->tl", weights[r0:r1], s)
        out[r0:r1] = select_topk(scores, row_pos[r0:r1].long(), topk)
    return out


@register("indexer_rows", "torch_fp8q")
def indexer_topk_rows_torch_fp8q(*args, **kwargs) -> torch.Tensor:
    """indexer_topk_rows_torch with the query rounded to fp8 against an fp8 cache."""
    return indexer_topk_rows_torch(*args, **kwargs, query="fp8")
