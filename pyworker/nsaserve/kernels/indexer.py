"""Lightning indexer: scores of every query against its request's cached keys, then causal top-k.

    I[t, s] = sum_h w[t, h] * relu(scale * q[t, h] . k[s])        for key positions s <= pos(t)

Top-k rule (deterministic, and the contract for every backend): a query whose causal context
(pos + 1 keys) fits in `topk` selects all of it; otherwise the `topk` highest scores, and among
equal scores the LOWER position wins. The result is logical positions (0-based within the request),
padded with -1, [T, K] with K = min(topk, longest context in the batch).

With few indexer heads ReLU makes many scores exactly 0, so the tie rule matters; it is applied by a
stable descending sort over keys in position order.

Query modes: "float32" (the default: q as given) or "fp8", DeepSeek-V3.2's inference path for an
fp8 index-key cache: q rounded to e4m3 per token and head (one block of head_dim <= 128 values)
with a power-of-two scale, then fp8 x fp8 products (quantize_query_fp8). The "_fp8q" backends use
it when the cache is fp8 and keep float32 queries against a bf16 cache.
"""

from __future__ import annotations

import torch

from .kv_cache_format import gather_index_k
from .registry import register

FP8_QUERY_BLOCK = 128  # head_dim values sharing one query scale (DeepSeek-V3.2's block size)

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


def query_fp8_exponent(amax: torch.Tensor) -> torch.Tensor:
    """E = floor(log2(amax)) from the float32 bits, clamped to [-110, 110]: the query block is
    scaled by 2^(7 - E) (largest magnitude in [128, 256), inside e4m3's 448) before rounding, and
    its products by 2^(E - 7) after. Powers of two scale exactly, so the Triton kernel and this
    reference round the same values."""
    bits = amax.float().contiguous().view(torch.int32)
    return (((bits >> 23) & 0xFF) - 127).clamp(-110, 110)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32, e an int32 tensor in the normal range."""
    return ((e + 127) << 23).to(torch.int32).view(torch.float32)


def quantize_query_fp8(q: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] float32 (D <= FP8_QUERY_BLOCK) -> its e4m3 rounding per (token, head), dequantised."""
    assert q.shape[-1] <= FP8_QUERY_BLOCK, "one query scale per head: head_dim <= 128"
    e = query_fp8_exponent(q.abs().amax(dim=-1, keepdim=True))
    q8 = (q.float() * pow2(7 - e)).to(torch.float8_e4m3fn)
    return q8.float() * pow2(e - 7)


def query_for_cache(q: torch.Tensor, index_k_cache: torch.Tensor, query: str) -> torch.Tensor:
    """The query the scores use: quantised to fp8 in the "fp8" mode against an fp8 (uint8) cache."""
    if query == "fp8" and index_k_cache.dtype == torch.uint8:
        return quantize_query_fp8(q)
    if query not in ("float32", "fp8"):
        raise ValueError(f"unknown indexer query mode {query!r}")
    return q


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
    plan=None,  # the step's IndexerPlan (kernels/indexer_plan.py): device backends use it, this one loops
    query: str = "float32",  # or "fp8" (see the module docstring)
) -> torch.Tensor:
    q = query_for_cache(q, index_k_cache, query)
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


@register("indexer", "torch_fp8q")
def indexer_topk_torch_fp8q(*args, **kwargs) -> torch.Tensor:
    """indexer_topk_torch with the query rounded to fp8 against an fp8 cache (DeepSeek-V3.2's path)."""
    return indexer_topk_torch(*args, **kwargs, query="fp8")


def whole_context(row_pos: torch.Tensor, width: int) -> torch.Tensor:
    """Logical positions [T, width]: row t's whole causal context 0..row_pos[t], then -1. The
    top-k of a row whose context holds at most top-k keys, whatever their scores (the indexer
    backends return the same set). No host sync: CUDA graphs capture it."""
    cols = torch.arange(width, device=row_pos.device)
    return torch.where(cols[None, :] <= row_pos[:, None].long(), cols[None, :], -1)


def topk_to_slots(topk_pos: torch.Tensor, token_kv_base: torch.Tensor, kv_slots: torch.Tensor) -> torch.Tensor:
    """Logical top-k positions [T, K] -> physical KV slots (-1 stays -1).

    token_kv_base[t] = kv_start[request of t]; the one place logical positions become slots.
    """
    valid = topk_pos >= 0
    idx = torch.where(valid, topk_pos + token_kv_base[:, None], 0)
    return torch.where(valid, kv_slots[idx], -1)
