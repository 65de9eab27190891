"""Logical (JSON) form <-> typed protocol messages, for the golden vectors."""

from __future__ import annotations

import math

import msgpack
import numpy as np

from nsaserve.protocol.arrays import I32, U32, U64
from nsaserve.protocol.builder import RequestSpec, SamplingSpec, build_plan
from nsaserve.protocol.messages import (
    SHUTDOWN,
    Fatal,
    Heartbeat,
    Hello,
    LateMasks,
    PromptLogprobs,
    StepResult,
    TokenLogprobs,
    encode_plan,
)


def plan_from_json(c: dict):
    reqs = [
        RequestSpec(
            id=q["id"],
            input_ids=q["input_ids"],
            cached_len=q["cached_len"],
            pages=q["pages"],
            out_slots=q["out_slots"],
            sample=q["sample"],
            prompt_logprobs=q["prompt_logprobs"],
            next_prompt_token=q["next_prompt_token"],
            input_prev_row=q["input_prev_row"],
            sampling=SamplingSpec(**q["sampling"]),
            history=q["history"],
            history_prompt_len=q["history_prompt_len"],
            history_reset=q["history_reset"],
            allowed_tokens=q.get("allowed_tokens"),
            mask_late=q.get("mask_late", False),
        )
        for q in c["requests"]
    ]
    return build_plan(c["step"], c["page_size"], reqs, c["released"])


def result_from_json(c: dict) -> StepResult:
    sampled = [
        (s["req_id"], s["token"], None if s["logprob"] is None else TokenLogprobs(s["logprob"], [tuple(t) for t in s["top"]]))
        for s in c["sampled"]
    ]
    prompt = [
        PromptLogprobs(p["req_id"], p["first_pos"], p["tokens"], [TokenLogprobs(lp, [tuple(t) for t in top]) for lp, top in p["entries"]])
        for p in c["prompt_logprobs"]
    ]
    return StepResult(c["step"], sampled, prompt, [tuple(e) for e in c["errors"]], c["forward_ms"])


def masks_from_json(c: dict) -> LateMasks:
    words = [w for _, ws in c["masks"] for w in ws]
    start = np.cumsum([0] + [len(ws) for _, ws in c["masks"]])
    return LateMasks(
        c["step"],
        np.array([r for r, _ in c["masks"]], dtype=U64),
        start.astype(I32),
        np.array(words, dtype=U32),
    )


def build_message(c: dict) -> bytes:
    kind = c["kind"]
    fields = {k: v for k, v in c.items() if k != "kind"}
    if kind == "plan":
        return encode_plan(plan_from_json(c))
    if kind == "result":
        return result_from_json(c).encode()
    if kind == "hello":
        return Hello(**fields).encode()
    if kind == "heartbeat":
        return Heartbeat(**fields).encode()
    if kind == "fatal":
        return Fatal(**fields).encode()
    if kind == "masks":
        return masks_from_json(c).encode()
    if kind == "shutdown":
        return SHUTDOWN
    raise ValueError(kind)


def nan_to_none(x: float) -> float | None:
    return None if math.isnan(x) else x


def unpack(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False)
