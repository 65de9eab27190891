"""Builds valid plans from per-request sampling settings, for sampler tests and benchmarks.

Each request runs `query_len` tokens ending at position `seq_len - 1`; its KV pages are laid
out one after another. History follows the router's rule: sent only when a penalty is set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..protocol.messages import Plan
from ..protocol.validate import implied_mode


@dataclass
class SamplingRequest:
    prompt: list[int] = field(default_factory=lambda: [1, 2, 3])
    generated: list[int] = field(default_factory=list)
    query_len: int = 1  # tokens run this step (the last ones of prompt + generated)
    sample: bool = True
    prompt_logprobs: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    top_logprobs: int = -1
    req_id: int | None = None  # default: the request's index

    @property
    def seq_len(self) -> int:
        return len(self.prompt) + len(self.generated)

    def needs_history(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def make_plan(reqs: list[SamplingRequest], page_size: int = 16, step: int = 0) -> Plan:
    seq = np.array([r.seq_len for r in reqs], dtype=np.int64)
    qlen = np.array([r.query_len for r in reqs], dtype=np.int64)
    if np.any(qlen < 1) or np.any(qlen > seq):
        raise ValueError("each request must run between 1 and seq_len tokens")
    cached = seq - qlen
    npages = -(-seq // page_size)
    page_start = np.concatenate([[0], np.cumsum(npages)])
    tokens, positions, slots, hist = [], [], [], []
    for i, r in enumerate(reqs):
        allt = r.prompt + r.generated
        pos = np.arange(cached[i], seq[i])
        tokens.append(np.array(allt[cached[i] :], dtype=np.int64))
        positions.append(pos)
        slots.append((page_start[i] + pos // page_size) * page_size + pos % page_size)
        hist.append(np.array(allt if r.needs_history() else [], dtype=np.int64))

    def cat(parts) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def col(name: str, dtype) -> np.ndarray:
        return np.array([getattr(r, name) for r in reqs], dtype=dtype)

    return Plan(
        step=step,
        mode=implied_mode(qlen),
        page_size=page_size,
        req_ids=np.array([i if r.req_id is None else r.req_id for i, r in enumerate(reqs)], dtype=np.uint64),
        query_start=np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32),
        input_ids=cat(tokens).astype(np.int32),
        positions=cat(positions).astype(np.int32),
        cached_lens=cached.astype(np.int32),
        page_start=page_start.astype(np.int32),
        page_table=np.arange(page_start[-1], dtype=np.int32),
        out_slots=cat(slots).astype(np.int32),
        sample=col("sample", np.uint8),
        prompt_logprobs=col("prompt_logprobs", np.uint8),
        temperature=col("temperature", np.float32),
        top_p=col("top_p", np.float32),
        top_k=col("top_k", np.int32),
        min_p=col("min_p", np.float32),
        repetition_penalty=col("repetition_penalty", np.float32),
        frequency_penalty=col("frequency_penalty", np.float32),
        presence_penalty=col("presence_penalty", np.float32),
        seed=np.array([r.seed or 0 for r in reqs], dtype=np.uint64),
        has_seed=np.array([r.seed is not None for r in reqs], dtype=np.uint8),
        top_logprobs=col("top_logprobs", np.int32),
        history_start=np.concatenate([[0], np.cumsum([len(h) for h in hist])]).astype(np.int32),
        history=cat(hist).astype(np.int32),
        history_prompt_lens=np.array([len(r.prompt) if r.needs_history() else 0 for r in reqs], dtype=np.int32),
    )
