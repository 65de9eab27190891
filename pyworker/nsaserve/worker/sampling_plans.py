"""Builds valid plans from per-request sampling settings, for sampler tests and benchmarks.

Each request runs `query_len` tokens ending at position `seq_len - 1`; its KV pages are laid
out one after another. History follows the router's rule: sent only when a penalty is set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..protocol.builder import RequestSpec, SamplingSpec, build_plan
from ..protocol.messages import Plan


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
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias
    allowed: list[int] | None = None  # structured output: the tokens allowed (None: all)
    req_id: int | None = None  # default: the request's index

    @property
    def seq_len(self) -> int:
        return len(self.prompt) + len(self.generated)

    def needs_history(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def mask_words(allowed: list[int]) -> list[int]:
    """The plan's bitmask words for a set of allowed token ids (bit t % 32 of word t // 32)."""
    words = [0] * (max(allowed) // 32 + 1)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return words


def make_plan(reqs: list[SamplingRequest], page_size: int = 16, step: int = 0) -> Plan:
    specs, next_page = [], 0
    for i, r in enumerate(reqs):
        if not 1 <= r.query_len <= r.seq_len:
            raise ValueError("each request must run between 1 and seq_len tokens")
        all_tokens = r.prompt + r.generated
        cached = r.seq_len - r.query_len
        npages = -(-r.seq_len // page_size)
        specs.append(
            RequestSpec(
                id=i if r.req_id is None else r.req_id,
                input_ids=all_tokens[cached:],
                cached_len=cached,
                pages=list(range(next_page, next_page + npages)),
                sample=r.sample,
                prompt_logprobs=r.prompt_logprobs,
                sampling=SamplingSpec(
                    temperature=r.temperature,
                    top_p=r.top_p,
                    top_k=r.top_k,
                    min_p=r.min_p,
                    repetition_penalty=r.repetition_penalty,
                    frequency_penalty=r.frequency_penalty,
                    presence_penalty=r.presence_penalty,
                    seed=r.seed,
                    top_logprobs=None if r.top_logprobs < 0 else r.top_logprobs,
                    logit_bias=sorted(r.logit_bias.items()),
                ),
                history=all_tokens if r.needs_history() else [],
                history_prompt_len=len(r.prompt) if r.needs_history() else 0,
                allowed_tokens=None if r.allowed is None else mask_words(r.allowed),
            )
        )
        next_page += npages
    return build_plan(step, page_size, specs)
