"""Typed protocol messages and their msgpack encoding (the Python half of router/src/protocol).

Keys and array layouts are the protocol, documented in docs/protocol.md and pinned by the golden
vectors in tests/golden/, which both `cargo test` and pytest decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgpack
import numpy as np

from .arrays import F32, I32, U8, U32, U64, ProtocolError, to_bin, view

PROTOCOL_VERSION = 6

MODES = ("idle", "prefill", "decode", "mixed")


@dataclass
class Plan:
    """One step's batch plan as numpy views over the received bytes (struct of arrays)."""

    step: int
    mode: str
    page_size: int
    req_ids: np.ndarray  # u64 [n]
    query_start: np.ndarray  # i32 [n+1], offsets into input_ids
    input_ids: np.ndarray  # i32 [T]
    positions: np.ndarray  # i32 [T]
    cached_lens: np.ndarray  # i32 [n]
    page_start: np.ndarray  # i32 [n+1], offsets into page_table
    page_table: np.ndarray  # i32 [P], every request's whole page list, concatenated
    out_slots: np.ndarray  # i32 [T], KV slot each new token writes
    sample: np.ndarray  # u8 [n]
    prompt_logprobs: np.ndarray  # u8 [n]
    next_prompt_token: np.ndarray  # i32 [n], prompt token after a non-final chunk (for prompt logprobs), else -1
    # i32 [n]: -1, or the request's row in the previous step's plan whose sampled token is its
    # one input token (then input_ids holds -1 there; the worker fills it in). See overlap.
    input_prev_row: np.ndarray
    temperature: np.ndarray  # f32 [n]
    top_p: np.ndarray
    top_k: np.ndarray  # i32 [n]
    min_p: np.ndarray
    repetition_penalty: np.ndarray
    frequency_penalty: np.ndarray
    presence_penalty: np.ndarray
    seed: np.ndarray  # u64 [n]
    has_seed: np.ndarray  # u8 [n]
    top_logprobs: np.ndarray  # i32 [n], -1 = no logprobs
    # Penalty histories. A request's segment extends what rank 0 holds for it from earlier
    # plans, or replaces it where history_reset is 1 (worker/penalty_history.py).
    history_start: np.ndarray  # i32 [n+1]
    history: np.ndarray  # i32 [H]
    history_prompt_lens: np.ndarray  # i32 [n], prompt tokens among the request's whole history
    history_reset: np.ndarray  # u8 [n]
    # OpenAI's logit_bias: (token, bias) pairs added to the raw logits before the penalties,
    # ids distinct and ascending per request.
    bias_start: np.ndarray  # i32 [n+1], offsets into bias_token / bias_value
    bias_token: np.ndarray  # i32 [B]
    bias_value: np.ndarray  # f32 [B]
    # Structured output: a request's allowed-token bitmask for this step (bit t % 32 of word
    # t // 32 allows token t; tokens past its last word are out), or no words (every token).
    mask_start: np.ndarray  # i32 [n+1], offsets into mask_words
    mask_words: np.ndarray  # u32 [M]
    # u8 [n]: 1 where the row's mask comes later, in a `masks` message for this step (overlap:
    # it depends on the token the request samples in the step before); see LateMasks.
    mask_late: np.ndarray
    # Requests that left since the previous plan: their held histories can go.
    released: np.ndarray  # u64 [R]

    def has_penalty(self) -> np.ndarray:
        """bool [n]: the request has a repetition, frequency or presence penalty (its sampler
        needs its token history)."""
        return (self.repetition_penalty != 1.0) | (self.frequency_penalty != 0.0) | (self.presence_penalty != 0.0)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


# Name and dtype of every array field of a plan, in wire order.
PLAN_ARRAYS: tuple[tuple[str, np.dtype], ...] = (
    ("req_ids", U64),
    ("query_start", I32),
    ("input_ids", I32),
    ("positions", I32),
    ("cached_lens", I32),
    ("page_start", I32),
    ("page_table", I32),
    ("out_slots", I32),
    ("sample", U8),
    ("prompt_logprobs", U8),
    ("next_prompt_token", I32),
    ("input_prev_row", I32),
    ("temperature", F32),
    ("top_p", F32),
    ("top_k", I32),
    ("min_p", F32),
    ("repetition_penalty", F32),
    ("frequency_penalty", F32),
    ("presence_penalty", F32),
    ("seed", U64),
    ("has_seed", U8),
    ("top_logprobs", I32),
    ("history_start", I32),
    ("history", I32),
    ("history_prompt_lens", I32),
    ("history_reset", U8),
    ("bias_start", I32),
    ("bias_token", I32),
    ("bias_value", F32),
    ("mask_start", I32),
    ("mask_words", U32),
    ("mask_late", U8),
    ("released", U64),
)


def _int(msg: dict, key: str, limit: int = 2**63) -> int:
    v = msg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < limit:
        raise ProtocolError(f"field {key!r} must be an integer in [0, {limit}), got {v!r}")
    return v


def unpack(data: bytes) -> dict:
    """msgpack bytes -> dict; anything that is not a map with a string `kind` is refused."""
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable message: {type(e).__name__}: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("kind"), str):
        raise ProtocolError("a message must be a map with a string 'kind'")
    return msg


def plan_from_msg(msg: dict) -> Plan:
    """Typed view of a plan message. Shapes are checked later by `validate_plan`."""
    if msg.get("kind") != "plan":
        raise ProtocolError(f"expected a plan, got kind {msg.get('kind')!r}")
    version = _int(msg, "version")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"plan has protocol version {version}, this worker speaks {PROTOCOL_VERSION}")
    mode = msg.get("mode")
    if mode not in MODES:
        raise ProtocolError(f"unknown forward mode {mode!r}")
    arrays = {name: view(msg, name, dt) for name, dt in PLAN_ARRAYS}
    return Plan(step=_int(msg, "step"), mode=mode, page_size=_int(msg, "page_size", 2**20), **arrays)


def encode_plan(plan: Plan) -> bytes:
    """The exact inverse of `plan_from_msg`; used by tests and fuzzers to build plans."""
    msg = {
        "kind": "plan",
        "version": PROTOCOL_VERSION,
        "step": plan.step,
        "mode": plan.mode,
        "page_size": plan.page_size,
        "num_reqs": plan.num_reqs,
        "num_tokens": plan.num_tokens,
        "num_pages": len(plan.page_table),
    }
    for name, dt in PLAN_ARRAYS:
        msg[name] = to_bin(getattr(plan, name), dt)
    return msgpack.packb(msg, use_bin_type=True)


@dataclass
class LateMasks:
    """The `masks` message: the allowed-token masks of a step's `mask_late` rows, sent to rank 0
    once the step before it is committed. A late row it leaves out samples unmasked (its request
    ended meanwhile, or its grammar had not started)."""

    step: int
    req_ids: np.ndarray  # u64 [m]
    mask_start: np.ndarray  # i32 [m+1], offsets into mask_words
    mask_words: np.ndarray  # u32 [M]

    def masks(self) -> dict[int, np.ndarray]:
        """Request id -> its mask words."""
        return {int(r): self.mask_words[self.mask_start[k] : self.mask_start[k + 1]] for k, r in enumerate(self.req_ids)}

    def encode(self) -> bytes:
        msg = {
            "kind": "masks",
            "step": self.step,
            "req_ids": to_bin(self.req_ids, U64),
            "mask_start": to_bin(self.mask_start, I32),
            "mask_words": to_bin(self.mask_words, U32),
        }
        return msgpack.packb(msg, use_bin_type=True)


def late_masks_from_msg(msg: dict) -> LateMasks:
    """Typed view of a `masks` message; its offsets are checked here, its rows against the plan
    by validate.apply_late_masks."""
    if msg.get("kind") != "masks":
        raise ProtocolError(f"expected masks, got kind {msg.get('kind')!r}")
    m = LateMasks(_int(msg, "step"), view(msg, "req_ids", U64), view(msg, "mask_start", I32), view(msg, "mask_words", U32))
    start = m.mask_start
    n = len(m.req_ids)
    if len(start) != n + 1 or start[0] != 0 or start[-1] != len(m.mask_words) or (np.diff(start) < 0).any():
        raise ProtocolError(f"masks: mask_start is not offsets 0..{len(m.mask_words)} over {n} requests")
    return m


@dataclass
class Hello:
    rank: int
    tp_size: int
    pid: int
    model_id: str
    num_pages: int
    page_size: int
    max_context: int
    vocab_size: int
    version: int = PROTOCOL_VERSION

    def encode(self) -> bytes:
        return msgpack.packb({"kind": "hello", **self.__dict__}, use_bin_type=True)


@dataclass
class Heartbeat:
    rank: int
    step: int

    def encode(self) -> bytes:
        return msgpack.packb({"kind": "heartbeat", "rank": self.rank, "step": self.step}, use_bin_type=True)


@dataclass
class Fatal:
    rank: int
    message: str

    def encode(self) -> bytes:
        return msgpack.packb({"kind": "fatal", "rank": self.rank, "message": self.message}, use_bin_type=True)


@dataclass
class TokenLogprobs:
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class PromptLogprobs:
    req_id: int
    first_pos: int  # position of the first token below; position 0 has no logprob
    tokens: list[int]
    entries: list[TokenLogprobs]


@dataclass
class StepResult:
    """Rank 0's answer to one plan."""

    step: int
    # (request id, sampled token, logprobs or None)
    sampled: list[tuple[int, int, TokenLogprobs | None]] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    errors: list[tuple[int, str]] = field(default_factory=list)
    forward_ms: float = 0.0

    def encode(self) -> bytes:
        def flat_top(tops):
            start, ids, lps = [0], [], []
            for top in tops:
                for tid, lp in top:
                    ids.append(tid)
                    lps.append(lp)
                start.append(len(ids))
            return to_bin(start, I32), to_bin(ids, I32), to_bin(lps, F32)

        s_top = flat_top([(lp.top if lp else []) for _, _, lp in self.sampled])
        entries = [e for p in self.prompt_logprobs for e in p.entries]
        p_top = flat_top([e.top for e in entries])
        p_start = np.cumsum([0] + [len(p.tokens) for p in self.prompt_logprobs])
        msg = {
            "kind": "result",
            "step": self.step,
            "req_ids": to_bin([r for r, _, _ in self.sampled], U64),
            "tokens": to_bin([t for _, t, _ in self.sampled], I32),
            "logprobs": to_bin([lp.logprob if lp else math.nan for _, _, lp in self.sampled], F32),
            "top_start": s_top[0],
            "top_ids": s_top[1],
            "top_logprobs": s_top[2],
            "prompt_req_ids": to_bin([p.req_id for p in self.prompt_logprobs], U64),
            "prompt_first_pos": to_bin([p.first_pos for p in self.prompt_logprobs], I32),
            "prompt_start": to_bin(p_start, I32),
            "prompt_tokens": to_bin([t for p in self.prompt_logprobs for t in p.tokens], I32),
            "prompt_logprobs": to_bin([e.logprob for e in entries], F32),
            "prompt_top_start": p_top[0],
            "prompt_top_ids": p_top[1],
            "prompt_top_logprobs": p_top[2],
            "errors": [[int(r), str(m)] for r, m in self.errors],
            "forward_ms": float(self.forward_ms),
        }
        return msgpack.packb(msg, use_bin_type=True)


SHUTDOWN = msgpack.packb({"kind": "shutdown"}, use_bin_type=True)
