"""Builds a `Plan` from per-request descriptions: the Python mirror of the router's
`BatchPlan::encode`, for tests, fuzzers and benchmarks (the router builds real plans)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .arrays import F32, I32, U8, U32, U64
from .messages import Plan
from .validate import implied_mode


@dataclass
class SamplingSpec:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    top_logprobs: int | None = None
    logit_bias: Sequence[tuple[int, float]] = ()  # (token id, bias), ids distinct and ascending


@dataclass
class RequestSpec:
    id: int
    input_ids: Sequence[int]
    cached_len: int
    pages: Sequence[int]
    out_slots: Sequence[int] | None = None  # None: derived from pages, as the router does
    sample: bool = True
    prompt_logprobs: bool = False
    next_prompt_token: int = -1
    input_prev_row: int = -1  # >= 0: input_ids must be [-1], filled from that row of step - 1
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    history: Sequence[int] = ()
    history_prompt_len: int = 0
    # Whether `history` is the whole history (replacing what the worker holds) or only the tokens
    # since the last plan that sent some. None: whole when the request has a history or a
    # penalty, as the router sends it the first time.
    history_reset: bool | None = None
    # Structured output: the allowed-token bitmask words of this step (None: every token).
    allowed_tokens: Sequence[int] | None = None
    # The mask comes in a `masks` message for this step instead (overlap).
    mask_late: bool = False

    def resets_history(self) -> bool:
        if self.history_reset is not None:
            return self.history_reset
        s = self.sampling
        return bool(self.history) or s.repetition_penalty != 1.0 or s.frequency_penalty != 0.0 or s.presence_penalty != 0.0


def slots_for(cached_len: int, n_new: int, pages: Sequence[int], page_size: int) -> list[int]:
    """The KV slot each of `n_new` tokens after `cached_len` writes, per the page list."""
    return [pages[p // page_size] * page_size + p % page_size for p in range(cached_len, cached_len + n_new)]


def _offsets(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(I32)


def build_plan(step: int, page_size: int, requests: Sequence[RequestSpec], released: Sequence[int] = ()) -> Plan:
    r = list(requests)
    slots = [
        list(q.out_slots) if q.out_slots is not None else slots_for(q.cached_len, len(q.input_ids), q.pages, page_size)
        for q in r
    ]
    qlens = [len(q.input_ids) for q in r]

    def flat(lists) -> np.ndarray:
        return np.array([x for lst in lists for x in lst], dtype=I32)

    def col(f, dt) -> np.ndarray:
        return np.array([f(q) for q in r], dtype=dt)

    return Plan(
        step=step,
        mode=implied_mode(np.array(qlens)),
        page_size=page_size,
        req_ids=col(lambda q: q.id, U64),
        query_start=_offsets(qlens),
        input_ids=flat(q.input_ids for q in r),
        positions=flat(range(q.cached_len, q.cached_len + len(q.input_ids)) for q in r),
        cached_lens=col(lambda q: q.cached_len, I32),
        page_start=_offsets([len(q.pages) for q in r]),
        page_table=flat(q.pages for q in r),
        out_slots=flat(slots),
        sample=col(lambda q: q.sample, U8),
        prompt_logprobs=col(lambda q: q.prompt_logprobs, U8),
        next_prompt_token=col(lambda q: q.next_prompt_token, I32),
        input_prev_row=col(lambda q: q.input_prev_row, I32),
        temperature=col(lambda q: q.sampling.temperature, F32),
        top_p=col(lambda q: q.sampling.top_p, F32),
        top_k=col(lambda q: q.sampling.top_k, I32),
        min_p=col(lambda q: q.sampling.min_p, F32),
        repetition_penalty=col(lambda q: q.sampling.repetition_penalty, F32),
        frequency_penalty=col(lambda q: q.sampling.frequency_penalty, F32),
        presence_penalty=col(lambda q: q.sampling.presence_penalty, F32),
        seed=col(lambda q: q.sampling.seed or 0, U64),
        has_seed=col(lambda q: q.sampling.seed is not None, U8),
        top_logprobs=col(lambda q: -1 if q.sampling.top_logprobs is None else q.sampling.top_logprobs, I32),
        history_start=_offsets([len(q.history) for q in r]),
        history=flat(q.history for q in r),
        history_prompt_lens=col(lambda q: q.history_prompt_len, I32),
        history_reset=col(lambda q: q.resets_history(), U8),
        bias_start=_offsets([len(q.sampling.logit_bias) for q in r]),
        bias_token=flat([t for t, _ in q.sampling.logit_bias] for q in r),
        bias_value=np.array([b for q in r for _, b in q.sampling.logit_bias], dtype=F32),
        mask_start=_offsets([len(q.allowed_tokens or ()) for q in r]),
        mask_words=np.array([w for q in r for w in q.allowed_tokens or ()], dtype=U32),
        mask_late=col(lambda q: q.mask_late, U8),
        released=np.array(list(released), dtype=U64),
    )
