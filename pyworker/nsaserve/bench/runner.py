"""Pacing: when each conversation starts (Poisson arrivals or all at once), how many run at once,
and the conversation loop itself (a turn goes out when the previous one has finished)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import numpy as np

from .client import HttpClient
from .datasets import Conversation
from .metrics import RequestResult
from .openai_api import ApiOptions, send


def arrival_times(rng: np.random.Generator, n: int, request_rate: float) -> list[float]:
    """Start offsets in seconds: 0 for all at a rate of inf, else a Poisson process (exponential
    gaps with mean 1 / rate), the first arrival at 0."""
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0:
        raise ValueError(f"request rate must be positive or inf, got {request_rate}")
    gaps = rng.exponential(1.0 / request_rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


async def run_load(
    client: HttpClient,
    opts: ApiOptions,
    conversations: list[Conversation],
    starts: list[float],
    max_concurrency: int | None,
    on_done: Callable[[RequestResult], None] = lambda r: None,
) -> tuple[list[RequestResult], float]:
    """Run every conversation; returns the results (in completion order) and the wall time from
    the first send to the last completion.

    `max_concurrency` counts conversations, not requests: a conversation holds its slot for all
    its turns, like a user waiting for each reply before typing the next question. For
    single-turn datasets that is the number of requests in flight."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult] = []
    t0 = time.perf_counter()

    async def one(conv: Conversation, start: float) -> None:
        delay = t0 + start - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is not None:
            await limit.acquire()
        try:
            for turn in conv.turns:
                sent = time.perf_counter() - t0
                r = await send(client, opts, turn)
                r.sent_s = sent
                results.append(r)
                # A failed turn does not stop the conversation: the history holds the dataset's
                # own replies, so later turns do not depend on this one's answer.
                on_done(r)
        finally:
            if limit is not None:
                limit.release()

    await asyncio.gather(*(one(c, s) for c, s in zip(conversations, starts)))
    return results, time.perf_counter() - t0
