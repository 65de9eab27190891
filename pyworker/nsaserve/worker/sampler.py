"""The worker's sampler (rank 0): one vectorised pass over the rows that sample this step.

Order of operations, as vLLM/SGLang users expect:
1. logit_bias, then penalties on the raw logits: repetition (HF style, prompt + generated
   tokens), then frequency and presence (OpenAI style, generated tokens only);
2. greedy rows (temperature < 1e-5, 0 included) take the argmax; ties go to the lowest token id;
3. other rows: divide by temperature, then top-k, top-p (on the top-k distribution), min-p,
   and draw from what is left with an exponential race (see sampling_noise).

Where the kernels allow (CUDA), steps 2-3 after the penalties are two fused passes: the filters
become one threshold per row ("sample_threshold": a few passes over each row, no sort) and the
pick divides by the temperature and applies it as it reads the logits ("sample_pick"). Elsewhere
process_logits (sampling_logits.py) does them step by step; both give the same tokens.

Logprobs are those of the raw model distribution (see sampling_logprobs).
Reproducibility: a seeded request's token depends only on its logits, its parameters, its seed
and the position of the token being sampled, never on the rest of the batch (its noise is the
same on every device; its logits, and so its token, may differ by a rounding between devices).
The caller's logits are not modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.registry import get_backend, resolve
from .sampling_batch import SamplingBatch
from .sampling_logits import apply_bias_and_penalties, process_logits
from .sampling_logprobs import prompt_logprobs, token_logprobs
from .sampling_noise import batch_uniform


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # int64 [S]
    logprobs: torch.Tensor  # f32 [S], NaN on rows that did not ask for logprobs
    # K = the most top logprobs any row asked for; a row that asked for n < K uses the first n
    # columns. Rows that did not ask hold id -1 and NaN.
    top_ids: torch.Tensor  # int64 [S, K]
    top_logprobs: torch.Tensor  # f32 [S, K]


def pick_tokens(
    x: torch.Tensor,
    u: torch.Tensor | None,
    sb: SamplingBatch,
    backend: str = "auto",
    temperature: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
) -> torch.Tensor:
    """argmax(x + Gumbel(u)) on sampling rows and argmax(x) on greedy rows, in one pass (kernel kind
    "sample_pick": fused on CUDA, the torch reference elsewhere). temperature: x is the raw
    (penalised) logits, divided by it in the same pass; threshold: the filters' cut per row of the
    divided logits (see fold_filters)."""
    if u is None:
        return x.argmax(dim=1)
    pick = get_backend("sample_pick", resolve("sample_pick", backend, x.device.type))
    return pick(x, u, sb.greedy if sb.any_greedy else None, temperature, threshold)


def plain_sampling(sb: SamplingBatch) -> bool:
    """No bias, penalty, top-k, top-p or min-p on any row: the processed logits are logits /
    temperature, which the pick can compute itself (host-side flags and shapes only; nothing waits
    on the device)."""
    return not sb.adjusts_logits and not has_filters(sb)


def has_filters(sb: SamplingBatch) -> bool:
    return sb.top_k_or_p_rows.numel() > 0 or sb.any_min_p


def fold_filters(sb: SamplingBatch, device_type: str, backend: str = "auto") -> bool:
    """Whether temperature and filters go into the pick: always when there are none, and wherever
    the threshold kernel is not the torch reference (which sorts every row; process_logits' topk
    path is faster on CPU)."""
    return plain_sampling(sb) or resolve("sample_threshold", backend, device_type) != "torch"


def draw_uniform(
    sb: SamplingBatch, vocab: int, device, generator: torch.Generator | None = None, backend: str = "auto"
) -> torch.Tensor | None:
    """The step's uniforms [S, V], or None when every row is greedy."""
    if sb.all_greedy:
        return None
    return batch_uniform(sb.num_rows, vocab, sb.seeded, device, generator, backend)


def sample(
    logits: torch.Tensor, sb: SamplingBatch, generator: torch.Generator | None = None, backend: str = "auto"
) -> SampleOutput:
    """Samples one token per row of `logits` [S, V] (row i = row i of `sb`), float32 or the model's
    dtype (decode graphs hand over lm_head's bf16 rows): every computation reads them as float32.

    `generator` drives the unseeded rows; by default torch's default generator of the device,
    so seeding torch once at worker launch makes a launch deterministic. `backend` names the
    sampling kernels ("auto": fused on CUDA, the torch references elsewhere).
    """
    S, V = logits.shape
    if S != sb.num_rows:
        raise ValueError(f"{S} rows of logits for a sampling batch of {sb.num_rows}")
    u = draw_uniform(sb, V, logits.device, generator, backend)
    if u is not None and fold_filters(sb, logits.device.type, backend):
        # Bias and penalties first (a new float32 tensor, only when some row has one); the
        # division and the filters' cut happen inside the pick: no pass over [S, V] for either.
        x = apply_bias_and_penalties(logits, sb, backend) if sb.adjusts_logits else logits
        th = None
        if has_filters(sb):
            find = get_backend("sample_threshold", resolve("sample_threshold", backend, x.device.type))
            th = find(x, sb.temperature, sb.top_k, sb.top_p, sb.min_p)
        tokens = pick_tokens(x, u, sb, backend, temperature=sb.temperature, threshold=th)
    else:
        tokens = pick_tokens(process_logits(logits, sb, backend), u, sb, backend)

    K = min(sb.max_top_logprobs, V)
    rows = sb.logprob_rows
    if rows.numel() == S and S:
        # Every row asked (the common case: one client's settings): no gather of the rows.
        lp, top_ids, top_lp = token_logprobs(logits, tokens, K, backend)
        return SampleOutput(tokens=tokens, logprobs=lp, top_ids=top_ids, top_logprobs=top_lp)
    lp = torch.full((S,), float("nan"), dtype=torch.float32, device=logits.device)
    top_ids = torch.full((S, K), -1, dtype=torch.int64, device=logits.device)
    top_lp = torch.full((S, K), float("nan"), dtype=torch.float32, device=logits.device)
    if rows.numel():
        chosen, ids, vals = token_logprobs(logits.index_select(0, rows), tokens.index_select(0, rows), K, backend)
        lp.index_copy_(0, rows, chosen)
        top_ids.index_copy_(0, rows, ids)
        top_lp.index_copy_(0, rows, vals)
    return SampleOutput(tokens=tokens, logprobs=lp, top_ids=top_ids, top_logprobs=top_lp)


__all__ = ["SampleOutput", "SamplingBatch", "sample", "prompt_logprobs", "pick_tokens", "plain_sampling", "fold_filters", "draw_uniform"]
