"""Mixture-of-experts routing (DeepSeek-V3 "noaux_tc") and the routed expert MLPs.

Routing, per token, in float32:
    s = sigmoid(router_logits);  b = s + e_score_correction_bias        (b only chooses)
    groups: score of a group = sum of its two best b; keep the best `topk_group` groups
    ids = top_k(b restricted to kept groups);  w = s[ids] / (sum s[ids] + 1e-20) * routed_scaling_factor
Expert e: down(silu(gate(x)) * up(x)); output = sum_k w_k * expert_{ids_k}(x).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import register


@register("moe_route", "torch")
def route_noaux_tc(
    router_logits: torch.Tensor,  # [T, E] float32
    correction_bias: torch.Tensor,  # [E] float32
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weights float32 [T, top_k], expert ids int64 [T, top_k])."""
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias.float()
    if n_group > 1 and topk_group < n_group:
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
        keep = group_score.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~group_mask[:, :, None], float("-inf")).view(num_tokens, num_experts)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


@register("moe_experts", "torch")
def moe_experts_torch(
    x: torch.Tensor,  # [T, H]
    expert_ids: torch.Tensor,  # int64 [T, k], global expert ids
    expert_weights: torch.Tensor,  # float32 [T, k]
    w13: torch.Tensor,  # [E_local, 2I, H]: gate rows then up rows
    w2: torch.Tensor,  # [E_local, H, I]
    first_expert: int,  # global id of local expert 0 (experts outside this rank are skipped)
) -> torch.Tensor:
    """Sum over the token's chosen experts that live on this rank -> float32 [T, H]."""
    num_local = w13.shape[0]
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    local = expert_ids - first_expert
    for e in torch.unique(local[(local >= 0) & (local < num_local)]).tolist():
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        h = F.linear(x[tok], w13[e])
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(h, w2[e]).float()
        out.index_add_(0, tok, y * expert_weights[tok, slot, None])
    return out
