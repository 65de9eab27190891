"""Step executors: what a worker does with a validated plan.

- `ModelExecutor` runs the model and the sampler (the real thing);
- `NullExecutor` returns deterministic tokens (and logprobs where asked) at once, without a
  model. It exists to measure the router alone (`--model-executor null`); it is never a default.
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from ..protocol.messages import Plan, StepResult, TokenLogprobs


class StepExecutor(Protocol):
    model_id: str
    num_pages: int
    page_size: int
    max_context: int
    vocab_size: int

    def run(self, plan: Plan, is_rank0: bool) -> StepResult:
        """Runs one validated plan. Every rank runs it; only rank 0's result is sent."""
        ...


class NullExecutor:
    """Deterministic tokens, no model: token = (31 * last input token + position) mod vocab."""

    def __init__(self, *, vocab_size: int, num_pages: int, page_size: int, max_context: int):
        self.model_id = "null"
        self.vocab_size = vocab_size
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_context = max_context
        self.dp_size = 1  # the worker sets tp_size under data-parallel attention (page ids span the pools)

    def run(self, plan: Plan, is_rank0: bool) -> StepResult:
        t0 = time.perf_counter()
        last = plan.query_start[1:].astype(np.int64) - 1
        rows = np.flatnonzero(plan.sample)
        toks = (31 * plan.input_ids[last[rows]].astype(np.int64) + plan.positions[last[rows]] + 1) % self.vocab_size
        toks = self._obey_masks(plan, rows, toks)
        sampled = [(int(plan.req_ids[i]), int(t), self._logprobs(int(plan.top_logprobs[i]), int(t))) for i, t in zip(rows, toks)]
        return StepResult(step=plan.step, sampled=sampled, forward_ms=(time.perf_counter() - t0) * 1e3)

    def _obey_masks(self, plan: Plan, rows: np.ndarray, toks: np.ndarray) -> np.ndarray:
        """Structured output: a row whose mask leaves its token out takes the next allowed id up
        (wrapping), as a sampler gives the left-out tokens no probability."""
        toks = toks.copy()
        for k, i in enumerate(rows):
            words = plan.mask_words[plan.mask_start[i] : plan.mask_start[i + 1]]
            if len(words):
                bits = np.unpackbits(words.astype("<u4").view(np.uint8), bitorder="little")[: self.vocab_size]
                allowed = np.flatnonzero(bits)
                if len(allowed):
                    at = np.searchsorted(allowed, toks[k])
                    toks[k] = allowed[at % len(allowed)]
        return toks

    def _logprobs(self, n: int, token: int) -> TokenLogprobs | None:
        """Made-up but well-formed logprobs, so the router's logprobs path is measured too: the
        token at -0.5, then the next n ids at falling logprobs (at most the vocabulary, as the real
        sampler returns). None where none were asked."""
        if n < 0:
            return None
        return TokenLogprobs(-0.5, [((token + j) % self.vocab_size, -0.5 - j) for j in range(min(n, self.vocab_size))])
