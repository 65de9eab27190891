"""A slow, per-request reference for the sampler, written from the definitions.

It reads each request straight from the plan, works in float64, and applies every rule the
direct way (min-p in probability space, top-p by walking the sorted tokens), so it shares no
code with the vectorised path beyond the greedy threshold and the Gumbel transform of the
uniforms. Tests compare the two on random batches. Not for serving: it loops in Python over
requests and tokens.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.sample_pick import gumbel
from ..protocol.messages import Plan
from .sampling_batch import GREEDY_TEMPERATURE


@dataclass
class ReferenceRow:
    token: int
    probs: torch.Tensor  # f64 [V]: the distribution the token was drawn from (one-hot if greedy)
    logprob: float  # raw-model logprob of the token
    top: list[tuple[int, float]]  # the request's top_logprobs most likely (id, raw logprob)


def reference_penalties(logits: torch.Tensor, plan: Plan, i: int) -> torch.Tensor:
    x = logits.double().clone()
    V = x.shape[0]
    for k in range(plan.bias_start[i], plan.bias_start[i + 1]):  # logit_bias first, as vLLM
        t = int(plan.bias_token[k])
        if 0 <= t < V:
            x[t] += float(plan.bias_value[k])
    hist = plan.history[plan.history_start[i] : plan.history_start[i + 1]].tolist()
    if plan.input_prev_row[i] >= 0 and hist:  # planned ahead: the pending input token joins it
        hist.append(int(plan.input_ids[plan.query_start[i]]))
    n_prompt = int(plan.history_prompt_lens[i])
    rep = float(plan.repetition_penalty[i])
    freq = float(plan.frequency_penalty[i])
    pres = float(plan.presence_penalty[i])
    if rep != 1.0 or freq != 0.0 or pres != 0.0:  # else the router sends no history
        for t in {t for t in hist if 0 <= t < V}:  # an id outside the vocabulary has no logit
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        for t, c in Counter(t for t in hist[n_prompt:] if 0 <= t < V).items():
            x[t] -= freq * c + pres
    words = [int(w) for w in plan.mask_words[plan.mask_start[i] : plan.mask_start[i + 1]]]
    if words:  # structured output: token t needs bit t % 32 of word t // 32
        for t in range(V):
            if t // 32 >= len(words) or not (words[t // 32] >> (t % 32)) & 1:
                x[t] = float("-inf")
    return x


def reference_filtered_probs(x: torch.Tensor, plan: Plan, i: int) -> torch.Tensor:
    """The renormalised distribution left after temperature, top-k, top-p and min-p (f64 [V])."""
    V = x.shape[0]
    x = x / float(plan.temperature[i])
    keep = torch.ones(V, dtype=torch.bool)
    k = int(plan.top_k[i])
    if 0 < k < V:
        kth = x.sort(descending=True).values[k - 1]
        keep &= x >= kth
    top_p = float(plan.top_p[i])
    if top_p < 1.0:
        p = torch.where(keep, x, float("-inf")).softmax(0)
        order = p.argsort(descending=True).tolist()
        mass, last = 0.0, order[0]
        for t in order:
            mass += float(p[t])
            last = t
            if mass >= top_p:
                break
        keep &= p >= p[last]
    min_p = min(max(float(plan.min_p[i]), 0.0), 1.0)
    if min_p > 0:
        p = torch.where(keep, x, float("-inf")).softmax(0)
        keep &= p >= min_p * p.max()
    return torch.where(keep, x, float("-inf")).softmax(0)


def reference_sample_row(logits: torch.Tensor, plan: Plan, i: int, uniform: torch.Tensor) -> ReferenceRow:
    """Request `i` of `plan` sampled from its logits [V] with its uniforms [V] (ignored if greedy)."""
    raw = torch.log_softmax(logits.double(), 0)
    x = reference_penalties(logits, plan, i)
    V = x.shape[0]
    if not float(plan.temperature[i]) >= GREEDY_TEMPERATURE:
        token = int(torch.nonzero(x == x.max())[0])  # lowest id among the maxima
        probs = torch.zeros(V, dtype=torch.float64)
        probs[token] = 1.0
    else:
        probs = reference_filtered_probs(x, plan, i)
        token = int((probs.log() + gumbel(uniform.double())).argmax())
    n = int(plan.top_logprobs[i])
    top = []
    if n > 0:
        order = np.argsort(-raw.numpy(), kind="stable")[:n]
        top = [(int(t), float(raw[t])) for t in order]
    return ReferenceRow(token=token, probs=probs, logprob=float(raw[token]), top=top)


def reference_sample(logits: torch.Tensor, plan: Plan, uniforms: torch.Tensor) -> list[ReferenceRow]:
    """Every request with `sample` set, in plan order; row j uses logits[j] and uniforms[j]."""
    rows = np.flatnonzero(plan.sample)
    return [reference_sample_row(logits[j].cpu(), plan, int(i), uniforms[j].cpu()) for j, i in enumerate(rows)]


def reference_prompt_logprobs(logits: torch.Tensor, next_tokens: torch.Tensor, k: int):
    """Row by row in float64: (logprobs [L], top ids [L][<=k], top logprobs [L][<=k])."""
    lps, ids, vals = [], [], []
    for row, t in zip(logits.cpu().double(), next_tokens.cpu().tolist()):
        lsm = torch.log_softmax(row, 0)
        lps.append(float(lsm[t]))
        order = np.argsort(-lsm.numpy(), kind="stable")[:k]
        ids.append([int(j) for j in order])
        vals.append([float(lsm[j]) for j in order])
    return lps, ids, vals
