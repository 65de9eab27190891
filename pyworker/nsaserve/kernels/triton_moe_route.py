"""Triton MoE routing (DeepSeek-V3 "noaux_tc"): sigmoid, correction bias, group-limited top-k and
the normalised, scaled weights in one launch. Same contract as moe.route_noaux_tc.

One program per token row, all experts in registers (E padded to a power of two with -inf):
    s = sigmoid(logits); b = s + bias                              (b only chooses)
    n_group > 1: a group's score = sum of its two best b; the topk_group best groups stay
    ids = the top_k best b among the kept experts (k rounds of arg-max; ties go to the lower id)
    w = s[ids] (/ (sum + 1e-20) when norm_topk_prob) * routed_scaling_factor
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, num_experts, routed_scaling_factor,
    E_P2: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
    K_P2: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_P2)
    live = offs < num_experts
    logits = tl.load(logits_ptr + row * num_experts + offs, mask=live, other=0.0).to(tl.float32)
    s = tl.sigmoid(logits)
    choice = tl.where(live, s + tl.load(bias_ptr + offs, mask=live, other=0.0), _NEG_INF)
    if N_GROUP > 1:
        GROUP: tl.constexpr = E_P2 // N_GROUP
        grouped = tl.reshape(choice, [N_GROUP, GROUP])
        in_group = tl.arange(0, GROUP)
        best = tl.max(grouped, 1)
        first = tl.argmax(grouped, 1)
        second = tl.max(tl.where(in_group[None, :] == first[:, None], _NEG_INF, grouped), 1)
        group_score = best + second
        groups = tl.arange(0, N_GROUP)
        keep = tl.zeros([N_GROUP], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            g = tl.argmax(tl.where(keep, _NEG_INF, group_score), 0)
            keep = keep | (groups == g)
        choice = tl.reshape(tl.where(keep[:, None], grouped, _NEG_INF), [E_P2])
    slots = tl.arange(0, K_P2)
    ids = tl.zeros([K_P2], dtype=tl.int64)
    w = tl.zeros([K_P2], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.argmax(choice, 0)
        ids = tl.where(slots == j, e.to(tl.int64), ids)
        w = tl.where(slots == j, tl.sum(tl.where(offs == e, s, 0.0), 0), w)
        choice = tl.where(offs == e, _NEG_INF, choice)
    if NORM:
        w = w / (tl.sum(w, 0) + 1e-20)
    out = row * TOP_K + slots
    tl.store(w_ptr + out, w * routed_scaling_factor, mask=slots < TOP_K)
    tl.store(ids_ptr + out, ids, mask=slots < TOP_K)


def route_noaux_tc_triton(
    router_logits: torch.Tensor,  # [T, E] float32
    correction_bias: torch.Tensor,  # [E] float32
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The registry's ("moe_route", "triton") backend -> (weights float32 [T, top_k], ids int64 [T, top_k])."""
    num_tokens, num_experts = router_logits.shape
    e_p2 = triton.next_power_of_2(num_experts)
    if n_group > 1 and (num_experts % n_group or e_p2 != num_experts or n_group & (n_group - 1)):
        raise ValueError(
            f"group-limited routing needs a power-of-two expert count split evenly, got {num_experts}/{n_group}"
        )
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            router_logits.contiguous(), correction_bias.float().contiguous(), weights, ids, num_experts,
            float(routed_scaling_factor), E_P2=e_p2, N_GROUP=n_group if topk_group < n_group else 1,
            TOPK_GROUP=topk_group, TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), NORM=bool(norm_topk_prob),
            num_warps=4 if e_p2 >= 256 else 1,
        )  # fmt: skip
    return weights, ids
