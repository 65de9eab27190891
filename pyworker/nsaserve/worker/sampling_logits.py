"""Logit processing, vectorised over the batch: penalties, temperature, top-k, top-p, min-p.

Every filter sets the logits of dropped tokens to -inf and keeps the rest unchanged, so the
result is the filtered distribution in logit form (softmax of it = the renormalised
distribution). The most likely token always survives, so no row is ever left empty.

Ties are kept together: each filter turns into a threshold on the logit and keeps every token
at or above it, so the result never depends on how a sort orders equal values.
"""

from __future__ import annotations

import torch

from ..kernels.registry import get_backend, resolve
from .sampling_batch import SamplingBatch


def allowed_token_mask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmask words [M, W] (int32 bit patterns) -> bool [M, vocab_size]: bit t % 32 of word
    t // 32 allows token t; tokens past the last word are not allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    # An arithmetic shift copies the sign bit in from the left, but `& 1` reads only bit k.
    bits = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    return torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=False)


def apply_bias_and_penalties(logits: torch.Tensor, sb: SamplingBatch, backend: str = "auto") -> torch.Tensor:
    """logit_bias, then repetition (HF style) and frequency/presence (OpenAI style) penalties, in
    float32 whatever the logits' dtype (decode graphs hand over bf16 rows); returns a new tensor
    when a row has a bias or a penalty, else the logits as float32 (no copy when they are float32
    already). The order is vLLM's: the bias moves the raw logit, the penalties then see it.

    - logit_bias: logit += bias for each (token, bias) of the row;
    - penalties (kernel kind "penalties", kernels/penalties.py): repetition r over prompt +
      generated tokens: positive logits / r, others * r; frequency f and presence q over generated
      tokens only: logit -= f * count + q * (count > 0).

    - structured output: a token its row's allowed-token mask leaves out gets -inf (the mask
      always allows some token, so no row is left empty).

    Only the biased tokens, the history's tokens and the masked rows change, so the work beyond
    the one float32 copy is O(biases + history + masked rows x vocabulary).
    """
    if not sb.adjusts_logits:
        return logits.float()
    S, V = logits.shape
    # One slot past the logits absorbs the writes that must not land (repeats of a pair, ids
    # outside the vocabulary), so that every write is unconditional and nothing waits on the host.
    flat = torch.empty(S * V + 1, dtype=torch.float32, device=logits.device)
    out = flat[: S * V].view(S, V)
    out.copy_(logits)  # the one copy, converted on the way
    if sb.bias_token.numel():
        tok = sb.bias_token
        at = torch.where((tok >= 0) & (tok < V), sb.bias_row * V + tok.clamp(0, V - 1), S * V)
        flat.index_add_(0, at, sb.bias_value)  # a row names a token once: one add per logit
    if sb.penalty_rows.numel():
        penalise = get_backend("penalties", resolve("penalties", backend, logits.device.type))
        penalise(
            flat, V, sb.history, sb.penalty_rows, sb.history_start, sb.history_len, sb.history_prompt,
            sb.history_pending, sb.history_first, sb.repetition_penalty, sb.frequency_penalty,
            sb.presence_penalty, sb.history_entries, sb.history_max,
        )  # fmt: skip
    if sb.mask_rows.numel():
        rows = sb.mask_rows
        allowed = allowed_token_mask(sb.mask_words, V)
        out.index_copy_(0, rows, out.index_select(0, rows).masked_fill_(~allowed, float("-inf")))
    return out


# Up to this many candidates, top-k (and top-p on top of it) reads the k largest logits
# instead of sorting the whole vocabulary; past it a full sort costs about the same.
CANDIDATE_LIMIT = 1024


def top_k_top_p_threshold(x: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Per row of `sb.top_k_or_p_rows`, the smallest logit top-k and top-p let through: [R, 1].

    top-k: the k-th largest logit. top-p works on the top-k distribution renormalised: the
    smallest prefix of tokens, most likely first, whose mass reaches top_p; its last logit.
    """
    rows = sb.top_k_or_p_rows
    sub = x if sb.top_k_or_p_all else x.index_select(0, rows)
    V = sub.shape[1]
    k = sb.top_k.index_select(0, rows)
    k = torch.where((k <= 0) | (k > V), V, k).unsqueeze(1)
    if sb.top_p_without_k or sb.max_top_k > CANDIDATE_LIMIT:
        vals = sub.sort(dim=1, descending=True).values
    else:
        # Every row here has a top-k no larger than max_top_k: its candidates are all in view.
        vals = sub.topk(min(sb.max_top_k, V), dim=1).values
    kth = vals.gather(1, k - 1)
    if not sb.any_top_p:
        return kth
    # Masses relative to the top-k set's total, taken over the whole row so that tokens tied
    # with the k-th value beyond the candidates still count.
    top = vals[:, :1]
    total = (sub - top).exp().masked_fill_(sub < kth, 0.0).sum(dim=1, keepdim=True)
    cum = (vals - top).exp().masked_fill_(vals < kth, 0.0).cumsum(dim=1) / total
    top_p = sb.top_p.index_select(0, rows).unsqueeze(1)
    # The cut is the first position whose cumulative mass reaches top_p; past position k - 1
    # only ties of the k-th value remain, so the cut never needs to go further.
    m = torch.minimum((cum < top_p).sum(dim=1, keepdim=True), k - 1)
    pth = vals.gather(1, m)
    pth = torch.where(top_p >= 1.0, float("-inf"), pth)  # top_p = 1 is off, whatever cum's rounding
    return torch.maximum(kth, pth)


def filter_logits(x: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Top-k, top-p and min-p on temperature-scaled logits; dropped tokens become -inf (new tensor)."""
    if sb.top_k_or_p_all:
        x = x.masked_fill(x < top_k_top_p_threshold(x, sb), float("-inf"))
    elif sb.top_k_or_p_rows.numel():
        th = top_k_top_p_threshold(x, sb)
        rows = sb.top_k_or_p_rows
        sub = x.index_select(0, rows)
        x = x.index_copy(0, rows, sub.masked_fill_(sub < th, float("-inf")))
    if sb.any_min_p:
        # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p): no softmax needed, and min_p = 0
        # gives -inf (keep all). Top-k/top-p never drop the maximum, so x_max is unchanged.
        log_min_p = torch.where(sb.min_p > 0, sb.min_p.log(), float("-inf")).unsqueeze(1)
        th = x.amax(dim=1, keepdim=True) + log_min_p
        x = x.masked_fill(x < th, float("-inf"))
    return x


def process_logits(logits: torch.Tensor, sb: SamplingBatch, backend: str = "auto") -> torch.Tensor:
    """Penalties, temperature, filters: the logits each non-greedy row samples from.

    Greedy rows come out penalised but otherwise unscaled (their temperature reads 1), so their
    argmax is the greedy token. A batch of greedy rows with no bias or penalty gets the logits
    back as they are (bf16 from the decode graphs): their argmax is the same token as that of the
    float32 copy (the conversion is exact and keeps the order, ties included), and the copy, a
    pass over [rows, vocab] at twice the bytes, is left out.
    """
    if sb.all_greedy and not sb.adjusts_logits:
        return logits
    x = apply_bias_and_penalties(logits, sb, backend)
    if sb.all_greedy:
        return x
    x = x / sb.temperature.unsqueeze(1)
    return filter_logits(x, sb)


__all__ = ["allowed_token_mask", "apply_bias_and_penalties", "filter_logits", "process_logits", "top_k_top_p_threshold"]
