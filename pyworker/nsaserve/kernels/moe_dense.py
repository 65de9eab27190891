"""Routed experts without host synchronisation (graph-safe torch reference).

moe.moe_experts_torch runs each expert on the tokens that chose it, which needs torch.unique and
nonzero (the host learns which experts got tokens): a CUDA graph cannot capture that. This
version runs every local expert on every token and weights the result by how much the token
chose it (0 for most): E_local times the work, same function. For tiny models and tests, not
for serving a 256-expert model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import register


@register("moe_experts", "torch_dense")
def moe_experts_dense_torch(
    x: torch.Tensor,  # [T, H]
    expert_ids: torch.Tensor,  # int64 [T, k], global expert ids
    expert_weights: torch.Tensor,  # float32 [T, k]
    w13: torch.Tensor,  # [E_local, 2I, H]: gate rows then up rows
    w2: torch.Tensor,  # [E_local, H, I]
    first_expert: int,
) -> torch.Tensor:
    """Same arguments and result (float32 [T, H]) as moe.moe_experts_torch."""
    num_local = w13.shape[0]
    inter = w13.shape[1] // 2
    local = expert_ids - first_expert
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in range(num_local):
        # A token picks an expert at most once, so this sum is its one weight (or 0).
        w = (expert_weights * (local == e)).sum(-1)
        h = F.linear(x, w13[e])
        y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], w2[e]).float()
        out += y * w[:, None]
    return out
