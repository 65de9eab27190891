"""Dense MLP and the MoE block (routed experts + shared experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.registry import get_backend
from .linear import Linear, empty_param


class GatedMLP(nn.Module):
    """down(silu(gate x) * up x), intermediate dim split across TP ranks; returns this rank's
    partial sum (the caller all-reduces)."""

    def __init__(self, hidden, inter, tp, *, dtype, device):
        super().__init__()
        i0, n = tp.split(inter, "MLP intermediate size")
        self.gate_proj = Linear(hidden, inter, dtype=dtype, device=device, shard_dim=0, start=i0, length=n)
        self.up_proj = Linear(hidden, inter, dtype=dtype, device=device, shard_dim=0, start=i0, length=n)
        self.down_proj = Linear(inter, hidden, dtype=dtype, device=device, shard_dim=1, start=i0, length=n)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DenseMLP(GatedMLP):
    def __init__(self, cfg, tp, *, dtype, device):
        super().__init__(cfg.hidden_size, cfg.intermediate_size, tp, dtype=dtype, device=device)
        self.tp = tp

    def forward(self, x, backends=None):
        return self.tp.all_reduce(super().forward(x))


class Router(nn.Module):
    def __init__(self, cfg, device):
        super().__init__()
        # float32 like the reference: routing decisions are sensitive to rounding.
        self.weight = empty_param([cfg.n_routed_experts, cfg.hidden_size], torch.float32, device)
        self.e_score_correction_bias = empty_param([cfg.n_routed_experts], torch.float32, device)


class MoE(nn.Module):
    def __init__(self, cfg, tp, *, dtype, device):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.first_expert, self.num_local = tp.split(cfg.n_routed_experts, "n_routed_experts")
        inter = cfg.moe_intermediate_size
        self.gate = Router(cfg, device)
        # Local experts fused as [E_local, 2I, H] (gate rows, then up rows) and [E_local, H, I]; the
        # loader fills them from the checkpoint's per-expert tensors (see expert_targets).
        self.w13 = empty_param([self.num_local, 2 * inter, cfg.hidden_size], dtype, device)
        self.w2 = empty_param([self.num_local, cfg.hidden_size, inter], dtype, device)
        self.shared_experts = (
            GatedMLP(cfg.hidden_size, inter * cfg.n_shared_experts, tp, dtype=dtype, device=device)
            if cfg.n_shared_experts
            else None
        )

    def expert_targets(self, prefix: str):
        """checkpoint name -> (param, index into it) or None when another rank owns the expert."""
        inter = self.cfg.moe_intermediate_size
        out = {}
        for e in range(self.cfg.n_routed_experts):
            local = e - self.first_expert
            mine = 0 <= local < self.num_local
            p = f"{prefix}experts.{e}."
            out[p + "gate_proj.weight"] = (self.w13, (local, slice(0, inter))) if mine else None
            out[p + "up_proj.weight"] = (self.w13, (local, slice(inter, 2 * inter))) if mine else None
            out[p + "down_proj.weight"] = (self.w2, (local,)) if mine else None
        return out

    def forward(self, x, backends):
        c = self.cfg
        logits = F.linear(x.float(), self.gate.weight)
        weights, ids = get_backend("moe_route", backends["moe_route"])(
            logits, self.gate.e_score_correction_bias, c.num_experts_per_tok, c.n_group, c.topk_group,
            c.norm_topk_prob, c.routed_scaling_factor,
        )  # fmt: skip
        y = get_backend("moe_experts", backends["moe_experts"])(x, ids, weights, self.w13, self.w2, self.first_expert)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x).float()
        return self.tp.all_reduce(y.to(x.dtype))
