"""log(sum(exp(x))) of each row, the normaliser of the logprobs returned to users.

Kind "row_logsumexp": (x [S, V] any float dtype) -> float32 [S]; computed on x.float(). A row's
logprobs are then x.float() - lse: no [S, V] float32 log_softmax is materialised, and the top
logprobs are the top raw logits shifted by the row's lse (the shift keeps their order).

The torch reference makes a float32 copy and takes torch.logsumexp (1.5 ms at 1024 rows of
GLM-5's 154,880 on an H200, more than the rest of the logprobs); the "triton" backend
(triton_row_logsumexp.py) reads each row twice in its own dtype (its max, then the sum of
exp(x - max)). Rows holding +inf give +inf, rows of -inf give -inf, as torch's.

Kind "row_lse_topk": (x [S, V], k >= 1) -> (lse float32 [S], the k largest values of each row
float32 [S, k] largest first, their indices int64 [S, k]): what a step with top logprobs needs,
the lse and the top-k. Among equal values, which indices are reported is unspecified. The
reference is the two above (torch.topk on x in its own dtype); the "triton" backend
(triton_row_lse_topk.py) reads each row once for both.
"""

from __future__ import annotations

import torch

from .registry import register


@register("row_logsumexp", "torch")
def row_logsumexp_torch(x: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(x.float(), dim=1)


# The largest k the Triton backend takes (its candidate list; the API allows 20 top logprobs).
LSE_TOPK_MAX_K = 32


@register("row_lse_topk", "torch")
def row_lse_topk_torch(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    top = x.topk(k, dim=1)
    return row_logsumexp_torch(x), top.values.float(), top.indices
