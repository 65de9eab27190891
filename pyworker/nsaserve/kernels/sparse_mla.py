"""Sparse MLA attention over the paged latent cache (absorbed form, one latent KV head).

    s[t, h, j] = scale * (q_lat[t, h] . c[slot_tj] + q_pe[t, h] . k_pe[slot_tj])
    o_lat[t, h] = sum_j softmax_j(s[t, h, :]) * c[slot_tj]

`slots` [T, K] are physical KV slots chosen for each query (the indexer's top-k mapped through the
page table); -1 marks an unused entry. Softmax and accumulation are float32.

Every "attention" backend also takes whole_contexts= (keyword): the caller's hint that each row is
its query's whole causal context followed by -1 padding (no context of the step exceeds the
top-k), so a backend may stop each row at its last valid entry. Results must not depend on it.

A backend may also plan a step once for all its layers: given a `plan_work(row_pos, width,
whole_contexts, graph)` attribute (row_pos: each row's position, so its list holds min(row_pos + 1,
width) valid entries first, then -1; graph: a CUDA-graph decode step), the model calls it once a
step for the calls over all of
the step's rows and passes what it returns (unless None) to every layer's call as work=
(triton_sparse_mla: a work plan, mla_work.py, or a row order, mla_rows.py).
"""

from __future__ import annotations

import torch

from .kv_cache_format import gather_latent
from .registry import register

# Bound on gathered latent elements per chunk of query rows (16 Mi float32 = 64 MiB).
_CHUNK_ELEMS = 1 << 24


@register("attention", "torch")
def sparse_mla_torch(
    q_lat: torch.Tensor,  # [T, H, R]
    q_pe: torch.Tensor,  # [T, H, P]
    latent_cache: torch.Tensor,  # one layer's latent cache (see kv_cache_format)
    slots: torch.Tensor,  # int64 [T, K], -1 = unused
    softmax_scale: float,
    whole_contexts: bool = False,  # a hint (module docstring); the reference reads every entry anyway
) -> torch.Tensor:
    num_tokens, heads, rank = q_lat.shape
    out = torch.empty(num_tokens, heads, rank, dtype=torch.float32, device=q_lat.device)
    width = max(1, slots.shape[1])
    rows = max(1, _CHUNK_ELEMS // (width * (rank + q_pe.shape[2])))
    for r0 in range(0, num_tokens, rows):
        r1 = min(num_tokens, r0 + rows)
        sl = slots[r0:r1]
        valid = sl >= 0
        c, k_pe = gather_latent(latent_cache, sl.clamp_min(0), rank)  # [t, K, R], [t, K, P]
        s = torch.einsum("thr,tkr->thk", q_lat[r0:r1].float(), c)
        s = s + torch.einsum("thp,tkp->thk", q_pe[r0:r1].float(), k_pe)
        s = (s * softmax_scale).masked_fill(~valid[:, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[r0:r1] = torch.einsum("thk,tkr->thr", p, c)
    return out
