"""Per-forward metadata derived from a ForwardBatch once and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.indexer_plan import IndexerPlan, plan_indexer
from ..kernels.rope import rope_cos_sin
from ..worker.host_to_device import upload
from .dense_prefill import dense_requests


@dataclass
class StepMeta:
    cos: torch.Tensor  # [T, rope_dim/2] float32, YaRN attention factor included
    sin: torch.Tensor
    # kv_start of each token's request: logical top-k position p of token t is physical slot
    # kv_slots[token_kv_base[t] + p] (kernels.indexer.topk_to_slots).
    token_kv_base: torch.Tensor  # int64 [T]
    # The indexer's per-row metadata (and prompt-chunk row blocks), for every indexer layer.
    indexer: IndexerPlan
    # No context of the step exceeds the top-k (index_topk): every row's top-k is its whole causal
    # context. The indexer then skips its scoring, and the attention lists are -1 padded contexts.
    whole_contexts: bool = False
    # The requests whose prompt tokens attend densely (model/dense_prefill.py), by index.
    dense_reqs: tuple[int, ...] = ()
    # Every request of the step attends densely: the indexer is skipped and nothing is sparse.
    dense: bool = False
    # A split step (some requests dense, some not): the tokens of the sparse ones, int64 on the device.
    sparse_rows: torch.Tensor | None = None
    # Under whole_contexts: the slots of every row's whole context, built by the first indexer
    # layer that needs them and read by the others (each layer built the same [T, top-k] tensor:
    # ~8 small kernels a layer, 4 MB each at 256 rows).
    whole_slots: torch.Tensor | None = None
    # The attention backend's plan for the step (its plan_work: kernels/mla_work.py's parts of
    # whole contexts, or kernels/mla_rows.py's row order), built by the first layer and read by the
    # others; False once the backend has said it plans nothing for this step.
    attention_work: object = None
    # A CUDA-graph decode step (static_kv_len: captured, or run before its capture to warm up).
    graph: bool = False


def build_step_meta(
    batch, inv_freq: torch.Tensor, attention_factor: float, dense_prefill: bool = False, index_topk: int = 0
) -> StepMeta:
    """index_topk: the model's top-k (0: unknown, no step counts as whole contexts).
    dense_prefill: the model's switch for dense attention of prompt tokens whose contexts fit
    index_topk (taken for the requests dense_prefill.dense_requests picks)."""
    cos, sin = rope_cos_sin(batch.positions, inv_freq, attention_factor)
    token_kv_base = batch.kv_start.to(torch.int64)[batch.token_req]
    static = batch.static_kv_len is not None  # CUDA-graph decode: host lists are placeholders
    indexer = plan_indexer(
        batch.positions,
        token_kv_base,
        batch.static_kv_len if static else max(batch.seq_lens_host, default=0),
        None if static else batch.query_start_host,
    )
    # Under CUDA graphs max_len is the graph's context bucket, fixed at capture.
    whole = indexer.max_len <= index_topk
    reqs: list[int] = []
    if dense_prefill and not static:
        reqs = dense_requests(batch.query_start_host, batch.seq_lens_host, index_topk)
    every = bool(reqs) and len(reqs) == len(batch.seq_lens_host)
    sparse_rows = None
    if reqs and not every:
        qs = np.asarray(batch.query_start_host, dtype=np.int64)
        dense_token = np.repeat(np.isin(np.arange(len(qs) - 1), reqs), np.diff(qs))
        sparse_rows = upload(np.flatnonzero(~dense_token), batch.positions.device, np.int64)
    return StepMeta(
        cos=cos, sin=sin, token_kv_base=token_kv_base, indexer=indexer, whole_contexts=whole,
        dense_reqs=tuple(reqs), dense=every, sparse_rows=sparse_rows, graph=static,
    )  # fmt: skip
