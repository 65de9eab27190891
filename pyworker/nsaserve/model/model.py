"""The decoder stack: embedding, layers (MLA + indexer attention, dense MLP or MoE), norm, lm_head.

Module and parameter names mirror the checkpoint's (model.layers.{i}.self_attn.q_a_proj.weight, ...,
and .weight_scale / .weight_scale_2 / .weight_scale_inv of quantised modules) so the loader maps
names one to one; only the routed experts are stacked on load. Each Linear is built in the precision
the checkpoint stores it in (weight_factory.py).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..kernels.registry import get_backend, load_backend
from .attention import MLAttention
from .dp_attention import DPStep
from .linear import Norm, empty_param
from .mlp import DenseMLP, MoE
from .parallel import TPGroup
from .quant_linear import QuantLinear
from .rope_params import rope_inv_freq
from .step_meta import build_step_meta
from .weight_factory import WeightFactory

DEFAULT_BACKENDS = {
    "attention": "torch", "indexer": "torch", "moe_route": "torch", "moe_experts": "torch",
    "rmsnorm": "torch", "rope": "torch", "kv_store": "torch", "index_key_store": "torch", "router_logits": "torch",
    "silu_mul": "torch",
}  # fmt: skip

# The eager forward's host path: "resolved" (kernel functions looked up once per change of the
# backend names, fewer small torch ops per layer) or "lookup" (a registry lookup per kernel call,
# the path before; kept to measure against, see bench/kernels/bench_step_host.py).
HOST_PATH_ENV = "NSASERVE_EAGER_HOST_PATH"


class Kernels(dict):
    """The kernel backends one forward uses: kind -> name as a dict (what the indexer and the
    CUDA graphs read) and kind -> function as attributes (kernels.rmsnorm(...)).

    resolved: every function is looked up (and a lazily imported Triton module imported) once,
    here, and stored as an attribute; otherwise each attribute access asks the registry."""

    def __init__(self, names: dict[str, str], resolved: bool = True):
        super().__init__(names)
        self.resolved = resolved
        if resolved:
            for kind, name in names.items():
                self.__dict__[kind] = load_backend(kind, name)

    def __getattr__(self, kind: str):  # reached only for kinds not stored as attributes
        if kind.startswith("__") or kind not in self:
            raise AttributeError(kind)
        return get_backend(kind, self[kind])


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer, tp, wf: WeightFactory, attn_tp: TPGroup | None = None):
        """attn_tp: the group attention splits its heads over (default tp; a group of one under
        data-parallel attention, see parallel.TPGroup.attention_group)."""
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = Norm(cfg.hidden_size, dtype=wf.dtype, device=wf.device)
        self.post_attention_layernorm = Norm(cfg.hidden_size, dtype=wf.dtype, device=wf.device)
        self.self_attn = MLAttention(cfg, layer, attn_tp or tp, wf)
        prefix = f"model.layers.{layer}.mlp."
        if cfg.mlp_layer_types[layer] == "sparse":
            self.mlp = MoE(cfg, tp, wf, prefix)
        else:
            self.mlp = DenseMLP(cfg, tp, wf, prefix)

    def forward(self, h, pending, batch, meta, pool, prev_topk_slots, kernels: Kernels, dp: DPStep | None = None):
        """h: the residual stream; pending: the previous layer's MLP output, not yet added to it
        (None before the first layer). Each residual add is fused into the RMSNorm that follows it.
        Returns (h, this layer's MLP output, top-k slots).

        dp: under data-parallel attention, the step's layout; the MLP then runs on the tokens of all
        ranks (dp_attention.py). batch None: this rank has no tokens this step; it skips attention
        and the norms but still joins the MLP's collectives with zero rows."""
        if batch is None:
            return h, dp.mlp(self.mlp, h, kernels), None
        rms_norm = kernels.rmsnorm
        if pending is None:
            x = rms_norm(h, self.input_layernorm.weight, self.eps)
        else:
            x, h = rms_norm(pending, self.input_layernorm.weight, self.eps, h)
        attn, topk_slots = self.self_attn(x, batch, meta, pool, prev_topk_slots, kernels)
        x, h = rms_norm(attn, self.post_attention_layernorm.weight, self.eps, h)
        return h, (self.mlp(x, kernels) if dp is None else dp.mlp(self.mlp, x, kernels)), topk_slots


class Backbone(nn.Module):
    def __init__(self, cfg, tp, wf: WeightFactory, attn_tp: TPGroup | None = None):
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = empty_param([cfg.vocab_size, cfg.hidden_size], wf.dtype, wf.device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, wf, attn_tp) for i in range(cfg.num_hidden_layers))
        self.norm = Norm(cfg.hidden_size, dtype=wf.dtype, device=wf.device)


class CausalLM(nn.Module):
    def __init__(self, cfg, tp: TPGroup, *, dtype, device, dp_attention: bool = False):
        """dp_attention: attention data parallel over the tp ranks (full heads on every rank, each
        serving its own requests), MLPs and lm_head split as without it (dp_attention.py)."""
        super().__init__()
        self.cfg, self.tp, self.dp_attention = cfg, tp, dp_attention
        wf = WeightFactory(dtype, device, cfg.quant)
        self.model = Backbone(cfg, tp, wf, tp.attention_group(dp_attention))
        v0, vn, self.vocab_share = tp.split_padded(cfg.vocab_size)
        self.lm_head = nn.Module()
        self.lm_head.weight = empty_param([vn, cfg.hidden_size], dtype, device, shard=(0, v0, vn))
        inv_freq, self.rope_attention_factor = rope_inv_freq(
            cfg.qk_rope_head_dim, cfg.rope_parameters, cfg.max_position_embeddings
        )
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.backends = dict(DEFAULT_BACKENDS)
        self.resolve_kernels = os.environ.get(HOST_PATH_ENV, "resolved") != "lookup"
        self._kernels: Kernels | None = None
        # Dense attention for prompt steps whose contexts fit the top-k (model/dense_prefill.py);
        # the worker turns it on for CUDA devices (--dense-prefill auto).
        self.dense_prefill = False

    def kernels(self) -> Kernels:
        """The backends in self.backends (set_backend writes there), resolved again only when a
        name changed since the last forward."""
        k = self._kernels
        stale = k is None or k.resolved != self.resolve_kernels
        if stale or not dict.__eq__(k, self.backends):
            k = self._kernels = Kernels(self.backends, self.resolve_kernels)
        return k

    def weight_targets(self) -> dict[str, tuple[torch.Tensor, tuple] | None]:
        """Every checkpoint tensor name this model expects -> (param, index) or None (the tensor
        exists but belongs to another rank). Missing/unexpected names are checked against this."""
        targets = {}
        for name, p in self.named_parameters():
            if ".mlp.w13." in name or ".mlp.w2." in name:
                continue
            targets[name] = (p, ())
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, MoE):
                targets.update(layer.mlp.expert_targets(f"model.layers.{i}.mlp."))
        return targets

    def ignored_tensors(self) -> set[str]:
        """Names the checkpoint may hold that are read past: the static activation scales
        (input_scale) of NVFP4 modules, which only W4A4 kernels use; we run W4A16."""
        names = set()
        for name, module in self.named_modules():
            if isinstance(module, QuantLinear):
                names.update(f"{name}.{s}" for s in module.IGNORED_SUFFIXES)
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, MoE):
                names.update(layer.mlp.expert_ignored(f"model.layers.{i}.mlp."))
        return names

    @torch.no_grad()
    def forward(
        self, batch, pool, dp: DPStep | None = None, float_logits: bool = True, logits_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """dp: under data-parallel attention, the step's layout (batch: this rank's requests, or None
        when it has none this step). float_logits=False: the logits as lm_head computes them, in the
        model's dtype (the decode graphs convert after the replay: the same values, half the bytes
        copied inside the graph). logits_out: with float_logits=False, a [rows, vocab] buffer that
        lm_head may write into (see _logits); the return value says where the logits are."""
        if dp is not None:
            return self._forward_dp(batch, pool, dp, float_logits)
        cfg = self.cfg
        if batch.num_tokens == 0:
            return torch.zeros(0, cfg.vocab_size, dtype=self._logits_dtype(float_logits), device=self.inv_freq.device)
        kernels = self.kernels()
        meta = self._step_meta(batch)
        h = self.model.embed_tokens.weight[batch.input_ids]
        pending = topk_slots = None
        for layer in self.model.layers:
            h, pending, topk_slots = layer(h, pending, batch, meta, pool, topk_slots, kernels)
        # Only the rows the sampler needs go through the last residual add, the final norm and lm_head.
        rms_norm, rows = kernels.rmsnorm, batch.logits_index
        if pending is None:
            h = rms_norm(h[rows], self.model.norm.weight, cfg.rms_norm_eps)
        else:
            h = rms_norm(pending[rows], self.model.norm.weight, cfg.rms_norm_eps, h[rows])[0]
        return self._logits(h, float_logits, logits_out)

    def _logits_dtype(self, float_logits: bool) -> torch.dtype:
        return torch.float32 if float_logits else self.lm_head.weight.dtype

    def _logits(self, h, float_logits: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        """lm_head on the final hidden rows (float32 unless asked otherwise), gathered over vocab shards.
        out: where the GEMM writes the logits when they need no conversion and no gather (one rank,
        the model's dtype), and out is their shape: the decode graphs' shared output buffer, which
        then needs no copy of a [rows, vocab] tensor per step. Otherwise out is not used."""
        w = self.lm_head.weight
        if (
            out is not None and not float_logits and self.tp.size == 1 and out.dtype == w.dtype
            and out.shape == (h.shape[0], w.shape[0]) and out.is_contiguous() and h.dtype == w.dtype
        ):  # fmt: skip
            return torch.mm(h, w.t(), out=out)
        logits = torch.nn.functional.linear(h, w)
        if float_logits:
            logits = logits.float()
        return self.tp.all_gather_rows(logits, self.vocab_share, self.cfg.vocab_size)

    def _step_meta(self, batch):
        return build_step_meta(
            batch, self.inv_freq, self.rope_attention_factor, self.dense_prefill, self.cfg.index_topk
        )

    def _forward_dp(self, batch, pool, dp: DPStep, float_logits: bool = True) -> torch.Tensor:
        """Data-parallel attention: attention on this rank's tokens, every MLP on all ranks' tokens,
        and the logit rows of all ranks in plan order. Every rank makes the same collective calls,
        whatever its share of the step (dp_attention.py)."""
        cfg, device = self.cfg, self.inv_freq.device
        if dp.max_tokens == 0:  # the same on every rank: no collective is skipped by one alone
            return torch.zeros(0, cfg.vocab_size, dtype=self._logits_dtype(float_logits), device=device)
        kernels = self.kernels()
        if batch is None:
            meta = None
            h = self.model.embed_tokens.weight.new_zeros(0, cfg.hidden_size)
        else:
            meta = self._step_meta(batch)
            h = self.model.embed_tokens.weight[batch.input_ids]
        pending = topk_slots = None
        for layer in self.model.layers:
            h, pending, topk_slots = layer(h, pending, batch, meta, pool, topk_slots, kernels, dp)
        if batch is None or batch.logits_index.numel() == 0:
            h = h.new_zeros(0, cfg.hidden_size)
        else:
            rows = batch.logits_index
            h = kernels.rmsnorm(pending[rows], self.model.norm.weight, cfg.rms_norm_eps, h[rows])[0]
        if max(dp.logit_rows) == 0:
            return torch.zeros(0, cfg.vocab_size, dtype=self._logits_dtype(float_logits), device=device)
        return self._logits(dp.gather_logit_rows(h), float_logits)
