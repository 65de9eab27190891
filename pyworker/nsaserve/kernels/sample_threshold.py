"""The sampler's filters as one number per row: the smallest processed logit that survives.

Kind "sample_threshold": (x [S, V] the raw (penalised) logits, any float dtype; temperature f32 [S]
(1 on greedy rows); top_k int64 [S] (<= 0 or >= V: off); top_p f32 [S] (>= 1: off); min_p f32 [S]
(0: off)) -> th f32 [S]. With y = x.float() / temperature, a token survives the filters when
y >= th; -inf keeps every token. th is the largest of:

- top-k: the k-th largest y (ties with it survive);
- top-p, on the top-k distribution renormalised: the largest y value v whose tokens at or above it
  hold at least top_p of that distribution's mass (the last logit of the shortest prefix, most
  likely first, whose cumulative mass reaches top_p); top_p <= 0 keeps only the maximum's ties;
- min-p: max(y) + log(min_p).

This is the worker's filter chain (worker/sampling_logits.py: top-k, then top-p on the top-k
distribution, then min-p), reduced to a threshold so that a fused pick can apply it while it reads
the logits (sample_pick's `threshold`). The reference below sorts every row; the "triton" backend
(triton_sample_threshold.py) finds the same values with a few passes over each row and no sort.
Masses are float32 sums, so top-p cuts that fall within rounding of top_p may differ between the
two; every other value is exact.
"""

from __future__ import annotations

import torch

from .registry import register


@register("sample_threshold", "torch")
def sample_threshold_torch(
    x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    S, V = x.shape
    y = x.float() / temperature.unsqueeze(1)
    vals = y.sort(dim=1, descending=True).values
    top = vals[:, :1]
    k_on = (top_k > 0) & (top_k < V)
    k = torch.where(k_on, top_k, V).unsqueeze(1)
    kth = vals.gather(1, k - 1)
    # Masses relative to the top-k set's total (ties with the k-th value included).
    e = (vals - top).exp().masked_fill_(vals < kth, 0.0)
    cum = e.cumsum(dim=1) / e.sum(dim=1, keepdim=True)
    p = top_p.unsqueeze(1)
    cut = torch.minimum((cum < p).sum(dim=1, keepdim=True), k - 1)
    pth = torch.where(p < 1.0, vals.gather(1, cut), float("-inf"))
    mth = torch.where(min_p > 0, top.squeeze(1) + min_p.log(), float("-inf"))
    kth = torch.where(k_on.unsqueeze(1), kth, float("-inf"))
    return torch.maximum(torch.maximum(kth, pth).squeeze(1), mth)
