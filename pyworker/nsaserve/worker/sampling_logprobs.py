"""Logprobs returned to users: always from the model's raw distribution.

Like vLLM's default, the logprob of a token is log_softmax of the unprocessed logits: no
penalties, temperature or top-k/top-p/min-p. The sampled token's logprob therefore describes the
model, not the sampler that picked it (a token outside the model's top-k can be reported even
when the request set top_k). The top entries are in decreasing logprob order; the order among
equal logprobs is unspecified.
"""

from __future__ import annotations

import torch

from ..kernels.registry import get_backend, resolve
from ..kernels.row_logsumexp import LSE_TOPK_MAX_K

# Rows taken at once by `prompt_logprobs`: bounds the scratch of a long prompt times a 150k
# vocabulary (the torch lse's float32 copy, topk's buffers) to a few hundred megabytes.
PROMPT_CHUNK_ROWS = 256


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of each row's token [N], top-k ids [N, k] int64, top-k logprobs [N, k] f32).

    logprob = x.float() - logsumexp(x.float()): only the [N] lse, the chosen logits and the top-k
    are computed, never an [N, V] log_softmax. The top-k is taken on the raw logits; subtracting
    one number per row keeps their order. With k > 0 and a "row_lse_topk" backend other than the
    torch reference (the Triton one reads each row once), both come from it; else the lse from
    "row_logsumexp" and the top-k from torch.topk.
    """
    k = min(k, logits.shape[1])
    device = logits.device.type
    fused = resolve("row_lse_topk", backend, device)
    if 0 < k <= LSE_TOPK_MAX_K and fused != "torch":
        lse, vals, ids = get_backend("row_lse_topk", fused)(logits, k)
    else:
        lse = get_backend("row_logsumexp", resolve("row_logsumexp", backend, device))(logits)
        if k:
            top = logits.topk(k, dim=1)
            vals, ids = top.values.float(), top.indices
        else:
            ids, vals = lse.new_empty(lse.shape[0], 0, dtype=torch.int64), lse.new_empty(lse.shape[0], 0)
    chosen = logits.gather(1, tokens.long().unsqueeze(1)).squeeze(1).float() - lse
    return chosen, ids, vals - lse.unsqueeze(1)


def prompt_logprobs(
    logits: torch.Tensor, next_tokens: torch.Tensor, k: int, chunk_rows: int = PROMPT_CHUNK_ROWS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of prompt tokens: row i of `logits` predicts `next_tokens[i]`.

    Returns (logprobs [L] f32, top ids [L, k] int64, top logprobs [L, k] f32), computed
    `chunk_rows` rows at a time to bound scratch memory.
    """
    L, V = logits.shape
    k = max(0, min(k, V))
    lp = torch.empty(L, dtype=torch.float32, device=logits.device)
    ids = torch.empty(L, k, dtype=torch.int64, device=logits.device)
    vals = torch.empty(L, k, dtype=torch.float32, device=logits.device)
    for a in range(0, L, chunk_rows):
        b = min(a + chunk_rows, L)
        lp[a:b], ids[a:b], vals[a:b] = token_logprobs(logits[a:b], next_tokens[a:b], k)
    return lp, ids, vals
