"""Lightning indexer: scores of every query against its request's cached keys, then causal top-k.

    I[t, s] = sum_h w[t, h] * relu(scale * q[t, h] . k[s])        for key positions s <= pos(t)

Top-k rule (deterministic, and the contract for every backend): a query whose causal context
(pos + 1 keys) fits in `topk` selects all of it; otherwise the `topk` highest scores, and among
equal scores the LOWER position wins. The result is logical positions (0-based within the request),
padded with -1, [T, K] with K = min(topk, longest context in the batch).

With few indexer heads ReLU makes many scores exactly 0, so the tie rule matters; it is applied by a
stable descending sort over keys in position order.
"""

from __future__ import annotations

import torch

from .kv_cache_format import gather_index_k
from .registry import register

# Bound on the [rows, heads, keys] float32 score block per chunk (64 Mi elements = 256 MiB).
_CHUNK_ELEMS = 1 << 26


def select_topk(scores: torch.Tensor, query_pos: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [Q, L] (keys in position order), query_pos [Q] -> logical positions [Q, min(topk, L)].

    Keys after the query's position are excluded; slots left over are -1.
    """
    num_keys = scores.shape[1]
    key_pos = torch.arange(num_keys, device=scores.device)
    future = key_pos[None, :] > query_pos[:, None]
    masked = scores.masked_fill(future, float("-inf"))
    k = min(topk, num_keys)
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :k]
    return torch.where(order > query_pos[:, None], -1, order)


@register("indexer", "torch")
def indexer_topk_torch(
    q: torch.Tensor,  # [T, H, D] float32, roped
    weights: torch.Tensor,  # [T, H] float32, weights_proj output already scaled by H^-0.5
    index_k_cache: torch.Tensor,  # one layer's index-key cache (see kv_cache_format)
    kv_slots: torch.Tensor,  # int64 [sum seq_lens], ForwardBatch.kv_slots
    query_start: list[int],  # host [n+1]
    cached_lens: list[int],  # host [n]
    seq_lens: list[int],  # host [n]
    topk: int,
    softmax_scale: float,
    page_size: int,
) -> torch.Tensor:
    num_tokens = q.shape[0]
    width = min(topk, max(seq_lens, default=0))
    out = torch.full((num_tokens, width), -1, dtype=torch.int64, device=q.device)
    kv_off = 0
    for i in range(len(seq_lens)):
        q0, q1, seq = query_start[i], query_start[i + 1], seq_lens[i]
        if q1 > q0:
            keys = gather_index_k(index_k_cache, kv_slots[kv_off : kv_off + seq], page_size)  # [L, D]
            qpos = torch.arange(cached_lens[i], cached_lens[i] + (q1 - q0), device=q.device)
            rows = max(1, _CHUNK_ELEMS // max(1, q.shape[1] * seq))
            for r0 in range(q0, q1, rows):
                r1 = min(q1, r0 + rows)
                s = torch.relu(torch.einsum("thd,ld->thl", q[r0:r1], keys) * softmax_scale)
                scores = torch.einsum("th,thl->tl", weights[r0:r1], s)
                sel = select_topk(scores, qpos[r0 - q0 : r1 - q0], topk)
                out[r0:r1, : sel.shape[1]] = sel
        kv_off += seq
    return out


def topk_to_slots(topk_pos: torch.Tensor, token_kv_base: torch.Tensor, kv_slots: torch.Tensor) -> torch.Tensor:
    """Logical top-k positions [T, K] -> physical KV slots (-1 stays -1).

    token_kv_base[t] = kv_start[request of t]; the one place logical positions become slots.
    """
    valid = topk_pos >= 0
    idx = torch.where(valid, topk_pos + token_kv_base[:, None], 0)
    return torch.where(valid, kv_slots[idx], -1)
