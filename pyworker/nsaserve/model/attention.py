"""MLA attention with the lightning indexer (DeepSeek Sparse Attention), absorbed form.

Per token x (after input_layernorm):
    qr = RMSNorm(q_a_proj x)                q = q_b_proj qr -> per head [q_nope | q_pe]
    ckv = kv_a_proj_with_mqa x -> c = RMSNorm(ckv[:R]),  k_pe = ckv[R:]   (one latent head)
    q_pe, k_pe get RoPE; (c, k_pe) go to the paged cache at the token's slot.
Absorbed attention: kv_b_proj per head is [W_UK (nope rows) | W_UV (v rows)] over the latent, so
    q_lat = q_nope W_UK,  o_lat = sparse attention over (c, k_pe) of the selected slots,
    o = o_lat W_UV^T,  out = o_proj(concat heads)  (all-reduced across TP ranks).
The same path serves prefill, decode and mixed batches: the current tokens are written first and
then read back through the cache like any other position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.indexer import topk_to_slots, whole_context
from ..kernels.registry import get_backend
from ..kernels.small_ops import IndexKeyPrep
from .dense_prefill import dense_attention
from .linear import Linear, Norm, stacked_weight
from .rope_params import mla_softmax_scale

# transformers and the DeepSeek reference build q_a_layernorm / kv_a_layernorm (and the indexer's
# LayerNorm) with eps 1e-6, not config.rms_norm_eps; we match them.
LORA_NORM_EPS = 1e-6
INDEXER_NORM_EPS = 1e-6


class Indexer(nn.Module):
    """Lightning indexer: scores keys with a few cheap heads and picks each query's top-k."""

    # Steps whose every context fits the top-k select whole contexts without scoring (forward).
    # Tests turn it off to check the scoring path picks the same.
    skip_scoring_when_all_fit = True

    def __init__(self, cfg, wf, prefix: str):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.interleaved = cfg.indexer_rope_interleave
        self.wq_b = wf.linear(prefix + "wq_b", cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = wf.linear(prefix + "wk", cfg.hidden_size, self.head_dim)
        self.k_norm = Norm(self.head_dim, dtype=wf.dtype, device=wf.device, bias=True)
        # Kept in float32 like the reference (weights_proj is never quantised).
        self.weights_proj = wf.linear(prefix + "weights_proj", cfg.hidden_size, self.n_heads, dtype=torch.float32)

    def forward(self, x, qr, layer, batch, meta, pool, backends):
        num_tokens = x.shape[0]
        backend = backends["indexer"]
        plan = meta.indexer  # row metadata built once per step (model/step_meta.py), shared by the layers
        # The key's LayerNorm, RoPE and, for the fp8 cache, the Hadamard rotation (as DeepSeek's
        # reference does before fp8-quantising the keys: same scores, smaller error) happen in the
        # store backend: one launch in the fused kernel where the reference takes nine.
        prep = IndexKeyPrep(
            self.k_norm.weight, self.k_norm.bias, INDEXER_NORM_EPS, meta.cos, meta.sin, self.interleaved, pool.fp8
        )  # fmt: skip
        store = get_backend("index_key_store", backends["index_key_store"])
        pool.write_index_k(layer, batch.out_slots, self.wk(x), store, prep=prep)
        if meta.dense:
            return None  # dense attention selects nothing: only the keys are needed (for later steps)
        if meta.whole_contexts and self.skip_scoring_when_all_fit:
            # No row of the step sees more than top-k keys, so each selects its whole causal
            # context whatever the scores: only the keys are needed (for later, longer steps).
            # Skips the query and weight projections, the logits and the top-k.
            if meta.whole_slots is None:
                meta.whole_slots = topk_to_slots(whole_context(plan.row_pos, plan.max_len), meta.token_kv_base, batch.kv_slots)
            return meta.whole_slots
        # The indexer ropes the FIRST rope_dim dims of its heads (MLA ropes the last ones): the rope
        # kernels rotate the first 2 * cos.shape[1] dims and pass the rest through.
        # With the fp8 cache the query is also Hadamard-rotated (as the keys are), float32 out.
        rope = get_backend("rope", backends["rope"])
        q_raw = self.wq_b(qr).view(num_tokens, self.n_heads, self.head_dim)
        q = rope(q_raw, meta.cos, meta.sin, self.interleaved, rotate=pool.fp8)
        weights = self.weights_proj(x.float()) * self.n_heads**-0.5
        if batch.static_kv_len is not None:  # no host lists (CUDA graphs): row metadata on the device
            topk_pos = get_backend("indexer_rows", backend)(
                q.float(), weights.float(), pool.index_k[layer], batch.kv_slots, plan.row_kv_off,
                plan.row_pos, plan.max_len, self.topk, self.head_dim**-0.5, pool.page_size,
            )  # fmt: skip
            return topk_to_slots(topk_pos, meta.token_kv_base, batch.kv_slots)
        topk_pos = get_backend("indexer", backend)(
            q.float(),
            weights.float(),
            pool.index_k[layer],
            batch.kv_slots,
            batch.query_start_host,
            batch.cached_lens_host,
            batch.seq_lens_host,
            self.topk,
            self.head_dim**-0.5,
            pool.page_size,
            plan=plan,
        )
        return topk_to_slots(topk_pos, meta.token_kv_base, batch.kv_slots)


class MLAttention(nn.Module):
    def __init__(self, cfg, layer: int, tp, wf):
        super().__init__()
        self.layer, self.tp = layer, tp
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        h0, self.heads = tp.split(cfg.num_attention_heads, "num_attention_heads")
        qk, kvb = cfg.qk_head_dim, self.nope + self.v_dim
        self.mla_interleaved = cfg.mla_rope_interleave
        self.softmax_scale = mla_softmax_scale(qk, cfg.rope_parameters)
        H, p = cfg.hidden_size, f"model.layers.{layer}.self_attn."
        self.q_a_proj = wf.linear(p + "q_a_proj", H, cfg.q_lora_rank)
        self.q_a_layernorm = Norm(cfg.q_lora_rank, dtype=wf.dtype, device=wf.device)

        def heads(dim: int, per_head: int) -> dict:
            """This rank's heads of a per-head weight; a group of one (TP=1, or data-parallel
            attention) reads the whole tensor, with no tp_shard."""
            if tp.size == 1:
                return {}
            return dict(shard_dim=dim, start=h0 * per_head, length=self.heads * per_head)

        self.q_b_proj = wf.linear(p + "q_b_proj", cfg.q_lora_rank, cfg.num_attention_heads * qk, **heads(0, qk))
        self.kv_a_proj_with_mqa = wf.linear(p + "kv_a_proj_with_mqa", H, self.rank + self.rope_dim)
        self.kv_a_layernorm = Norm(self.rank, dtype=wf.dtype, device=wf.device)
        self.kv_b_proj = wf.linear(p + "kv_b_proj", self.rank, cfg.num_attention_heads * kvb, **heads(0, kvb))
        self.o_proj = wf.linear(p + "o_proj", cfg.num_attention_heads * self.v_dim, H, **heads(1, self.v_dim))
        self.indexer = Indexer(cfg, wf, p + "indexer.") if cfg.indexer_types[layer] == "full" else None
        self.q_lora = cfg.q_lora_rank
        # q_a_proj and kv_a_proj_with_mqa read the same x: when both are plain Linears, one GEMM
        # on their stacked weights (linear.stacked_weight) serves both.
        self._qkv_a = None
        self._stack_qkv_a = isinstance(self.q_a_proj, Linear) and isinstance(self.kv_a_proj_with_mqa, Linear)

    def _q_and_kv_a(self, x, stacked: bool):
        if not (stacked and self._stack_qkv_a):
            return self.q_a_proj(x), self.kv_a_proj_with_mqa(x)
        self._qkv_a = w = stacked_weight(self._qkv_a, self.q_a_proj, self.kv_a_proj_with_mqa)
        qkv = F.linear(x.to(w.dtype), w)
        return qkv[:, : self.q_lora], qkv[:, self.q_lora :]

    def forward(self, x, batch, meta, pool, prev_topk_slots, kernels):
        """kernels: model.Kernels (the backend names by kind, and the resolved functions)."""
        num_tokens = x.shape[0]
        rms_norm = kernels.rmsnorm
        q_a, kv_a = self._q_and_kv_a(x, kernels.resolved)
        qr = rms_norm(q_a, self.q_a_layernorm.weight, LORA_NORM_EPS)
        q = self.q_b_proj(qr).view(num_tokens, self.heads, self.nope + self.rope_dim)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        q_pe = kernels.rope(q_pe, meta.cos, meta.sin, self.mla_interleaved)
        # kv_a_layernorm of the latent c, RoPE of k_pe, and both into the cache at the tokens' slots.
        kernels.kv_store(
            pool.latent[self.layer], batch.out_slots, kv_a, self.kv_a_layernorm.weight,
            LORA_NORM_EPS, meta.cos, meta.sin, self.mla_interleaved,
        )  # fmt: skip

        if self.indexer is not None:
            topk_slots = self.indexer(x, qr, self.layer, batch, meta, pool, kernels)
        elif prev_topk_slots is None and not meta.dense:
            raise RuntimeError(f"layer {self.layer} shares top-k but no earlier layer computed one")
        else:
            topk_slots = prev_topk_slots

        # A quantised kv_b_proj is dequantised here once per layer call (it is small: [heads*(nope+v), R]).
        w = self.kv_b_proj.dense_weight().view(self.heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        if not meta.dense_reqs:
            o = self._absorbed(q_nope, q_pe, topk_slots, w_uk, w_uv, pool, meta, kernels)
        else:
            # Prompt tokens whose contexts fit the top-k (the selection is every causal position)
            # attend causally in the non-absorbed form (model/dense_prefill.py); the step's other
            # tokens, if any, through the sparse kernels. The roped q_pe goes back into q, so that
            # dense attention reads each head's [nope | rope] query as it is, where a concatenation
            # per request cost nearly as much as the attention (H200, 16 prompts of 1000 tokens:
            # 19.4 ms of concatenations, q's and k's, against 23.8 ms of attention).
            o = x.new_empty(num_tokens, self.heads, self.v_dim)
            if meta.sparse_rows is not None:
                rows = meta.sparse_rows
                sparse = self._absorbed(q_nope[rows], q_pe[rows], topk_slots[rows], w_uk, w_uv, pool, meta, kernels)
                o.index_copy_(0, rows, sparse)
            q[..., self.nope :] = q_pe
            dense_attention(
                q, w_uk, w_uv, pool.latent[self.layer], batch, self.softmax_scale, list(meta.dense_reqs), out=o
            )  # fmt: skip
        o = o.reshape(num_tokens, self.heads * self.v_dim)
        return self.tp.all_reduce(self.o_proj(o)), topk_slots

    def _absorbed(self, q_nope, q_pe, topk_slots, w_uk, w_uv, pool, meta, kernels) -> torch.Tensor:
        """Sparse attention in the absorbed form over each token's selected latent rows -> o [t, H, v]."""
        num_tokens = q_nope.shape[0]
        whole = meta.whole_contexts  # every list a whole causal context, -1 padded
        work = self._work_plan(topk_slots, meta, kernels)
        extra = {} if work is None else {"work": work}
        if kernels.resolved:
            # The two absorbed products as batched matmuls over heads, written through [H, T, .]
            # views straight into token-major buffers, so that neither needs a copy after it
            # (the attention kernel reads q_lat contiguous; o_proj reads [T, H * v]).
            q_lat = q_nope.new_empty(num_tokens, self.heads, self.rank)
            torch.bmm(q_nope.transpose(0, 1), w_uk, out=q_lat.transpose(0, 1))
            o_lat = kernels.attention(
                q_lat, q_pe, pool.latent[self.layer], topk_slots, self.softmax_scale, whole_contexts=whole, **extra
            )  # fmt: skip
            o = q_nope.new_empty(num_tokens, self.heads, self.v_dim)
            torch.bmm(o_lat.to(q_nope.dtype).transpose(0, 1), w_uv.transpose(1, 2), out=o.transpose(0, 1))
            return o
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        o_lat = kernels.attention(
            q_lat, q_pe, pool.latent[self.layer], topk_slots, self.softmax_scale, whole_contexts=whole, **extra
        )  # fmt: skip
        return torch.einsum("thr,hvr->thv", o_lat.to(q_nope.dtype), w_uv)

    @staticmethod
    def _work_plan(topk_slots, meta, kernels):
        """The attention backend's plan for this step (its plan_work, where it has one), built once a
        step for every layer; None where there is none. Only for calls over every row of the step
        (a split step's sparse rows are a subset the plan does not know): plan_work takes the rows'
        positions (row t's list holds min(position + 1, width) entries, then -1), the lists' width,
        whether they are whole contexts and whether the step is a CUDA-graph one."""
        if meta.attention_work is None:
            plan = getattr(kernels.attention, "plan_work", None)
            rows = meta.indexer.row_pos
            every = meta.sparse_rows is None and rows.numel() == topk_slots.shape[0]
            work = plan(rows, topk_slots.shape[1], meta.whole_contexts, meta.graph) if plan is not None and every else None
            meta.attention_work = False if work is None else work
        return meta.attention_work or None
