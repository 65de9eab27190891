"""Dense MLP and the MoE block (routed experts + shared experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.router_logits import TAKES_SPLIT, split_bf16x3
from .linear import Linear, empty_param, stacked_weight

# Most bytes of dequantised expert weights a quantised MoE materialises at once; experts with tokens
# are processed in groups that fit (at least one expert per group).
DEQUANT_CHUNK_BYTES = 256 << 20


class GatedMLP(nn.Module):
    """down(silu(gate x) * up x), intermediate dim split across TP ranks; returns this rank's
    partial sum (the caller all-reduces)."""

    def __init__(self, hidden, inter, tp, wf, prefix: str):
        super().__init__()
        i0, n = tp.split(inter, "MLP intermediate size")
        self.gate_proj = wf.linear(prefix + "gate_proj", hidden, inter, shard_dim=0, start=i0, length=n)
        self.up_proj = wf.linear(prefix + "up_proj", hidden, inter, shard_dim=0, start=i0, length=n)
        self.down_proj = wf.linear(prefix + "down_proj", inter, hidden, shard_dim=1, start=i0, length=n)
        # gate and up read the same x: when both are plain Linears, one GEMM on their stacked
        # weights (linear.stacked_weight) serves both, and one "silu_mul" kernel reads its output.
        self._gate_up = None
        self._stack = isinstance(self.gate_proj, Linear) and isinstance(self.up_proj, Linear)

    def forward(self, x, silu_mul=None):
        """silu_mul: a "silu_mul" backend (the stacked path, gate and up in one GEMM); None: the
        separate projections and torch's silu and product (the model's plain definition)."""
        if silu_mul is None or not self._stack:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        self._gate_up = w = stacked_weight(self._gate_up, self.gate_proj, self.up_proj)
        return self.down_proj(silu_mul(F.linear(x.to(w.dtype), w)))


class DenseMLP(GatedMLP):
    def __init__(self, cfg, tp, wf, prefix: str):
        super().__init__(cfg.hidden_size, cfg.intermediate_size, tp, wf, prefix)
        self.tp = tp

    def partial(self, x, kernels=None):
        """This rank's share of the output, before the sum over ranks."""
        return super().forward(x, kernels.silu_mul if kernels is not None and kernels.resolved else None)

    def forward(self, x, kernels=None):
        return self.tp.all_reduce(self.partial(x, kernels))


class Router(nn.Module):
    def __init__(self, cfg, device):
        super().__init__()
        # float32 like the reference: routing decisions are sensitive to rounding.
        self.weight = empty_param([cfg.n_routed_experts, cfg.hidden_size], torch.float32, device)
        self.e_score_correction_bias = empty_param([cfg.n_routed_experts], torch.float32, device)
        self._split = None  # the weight's bf16 parts, for the "bf16x3" and "triton" logits

    @torch.no_grad()
    def split_weight(self) -> torch.Tensor:
        """The weight's bf16 parts (kernels/router_logits.split_bf16x3), built once: by the runner
        when the backend is chosen, else on the first forward (never inside a graph capture)."""
        if self._split is None:
            if self.weight.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("split the router weights before capturing a CUDA graph")
            self._split = split_bf16x3(self.weight)
        return self._split

    def logits(self, x, kernels) -> torch.Tensor:
        """float32 [T, E] router logits through the "router_logits" backend."""
        split = self.split_weight() if kernels["router_logits"] in TAKES_SPLIT else None
        return kernels.router_logits(x, self.weight, split)


class MoE(nn.Module):
    def __init__(self, cfg, tp, wf, prefix: str):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.first_expert, self.num_local = tp.split(cfg.n_routed_experts, "n_routed_experts")
        inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
        self.gate = Router(cfg, wf.device)
        # Local experts stacked as w13 [E_local, 2I, H] (gate rows, then up rows) and w2 [E_local, H, I],
        # in the checkpoint's precision (expert_stack.py); filled from the per-expert tensors.
        n = cfg.n_routed_experts
        self.w13 = wf.experts(prefix, n, self.num_local, ("gate_proj", "up_proj"), inter, hidden)
        self.w2 = wf.experts(prefix, n, self.num_local, ("down_proj",), hidden, inter)
        self.shared_experts = (
            GatedMLP(hidden, inter * cfg.n_shared_experts, tp, wf, prefix + "shared_experts.")
            if cfg.n_shared_experts
            else None
        )

    def _expert_prefixes(self, prefix: str):
        for e in range(self.cfg.n_routed_experts):
            local = e - self.first_expert
            yield f"{prefix}experts.{e}.", (local if 0 <= local < self.num_local else None)

    def expert_targets(self, prefix: str):
        """checkpoint name -> (param, index into it) or None when another rank owns the expert."""
        out = {}
        for expert_prefix, local in self._expert_prefixes(prefix):
            out.update(self.w13.targets(expert_prefix, local))
            out.update(self.w2.targets(expert_prefix, local))
        return out

    def expert_ignored(self, prefix: str) -> list[str]:
        """Per-expert tensors that may be on disk and are read past (NVFP4 input_scale)."""
        return [n for ep, _ in self._expert_prefixes(prefix) for n in self.w13.ignored(ep) + self.w2.ignored(ep)]

    def _routed(self, x, ids, weights, backend, every_expert: bool = False):
        """Sum over the chosen experts this rank owns -> float32 [T, H].

        every_expert: dequantise every local expert (in groups) rather than those that got tokens,
        so that the host never learns which ones did (no synchronisation; the "torch_dense"
        reference runs every expert on every token anyway)."""
        if not (self.w13.quantized or self.w2.quantized):
            return backend(x, ids, weights, self.w13.weight, self.w2.weight, self.first_expert)
        # Quantised: dequantise only the experts that got tokens, a bounded group at a time, and run
        # the same expert kernel on each group with the token's expert ids renumbered into it.
        local = ids - self.first_expert
        mine = (local >= 0) & (local < self.num_local)
        if every_expert:
            active = torch.arange(self.num_local, dtype=ids.dtype, device=ids.device)
        else:
            active = torch.unique(local[mine])
        per_group = max(
            1, DEQUANT_CHUNK_BYTES // (self.w13.dense_bytes_per_expert() + self.w2.dense_bytes_per_expert())
        )
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if active.numel() == 0:
            return out  # no token chose an expert of this rank
        clamped = local.clamp(0, self.num_local - 1)
        for group in active.split(per_group):
            position = torch.full((self.num_local,), -1, dtype=ids.dtype, device=ids.device)
            position[group] = torch.arange(len(group), dtype=ids.dtype, device=ids.device)
            group_ids = torch.where(mine, position[clamped], -1)
            out += backend(x, group_ids, weights, self.w13.dense(group), self.w2.dense(group), 0)
        return out

    def forward(self, x, kernels):
        """kernels: model.Kernels (the backend names by kind, and the resolved functions)."""
        return self.tp.all_reduce(self.partial(x, kernels))

    def partial(self, x, kernels):
        """This rank's share of the output (its routed experts + its slice of the shared ones),
        before the sum over ranks."""
        c = self.cfg
        logits = self.gate.logits(x, kernels)
        weights, ids = kernels.moe_route(
            logits, self.gate.e_score_correction_bias, c.num_experts_per_tok, c.n_group, c.topk_group,
            c.norm_topk_prob, c.routed_scaling_factor,
        )  # fmt: skip
        if kernels["moe_experts"] in ("torch", "torch_dense"):  # torch references take dense weights
            y = self._routed(x, ids, weights, kernels.moe_experts, kernels["moe_experts"] == "torch_dense")
        elif kernels["moe_experts"] == "triton" and self.shared_experts is not None and kernels.resolved:
            # The shared experts first: the routed experts' last launch adds their output to its
            # float32 sum and rounds to the model dtype (the same values as the branch below, two
            # launches fewer).
            shared = self.shared_experts(x, kernels.silu_mul)
            return kernels.moe_experts(x, ids, weights, self.w13, self.w2, self.first_expert, add=shared)
        else:  # fused kernels read the stacks in their checkpoint layout (no dequantised copy)
            y = kernels.moe_experts(x, ids, weights, self.w13, self.w2, self.first_expert)
        if self.shared_experts is not None:
            if kernels.resolved:
                y.add_(self.shared_experts(x, kernels.silu_mul))  # float32 += bf16: the same sum, one launch fewer
            else:
                y = y + self.shared_experts(x).float()
        return y.to(x.dtype)
