"""Overlap references on the worker: a plan's `input_prev_row` is filled in from what the
previous step sampled, and a reference that names anything else fails only its request.

The slow reference is running the same requests with their input tokens given (overlap off):
the null executor's tokens depend on the input token, so a wrongly filled reference shows."""

from __future__ import annotations

import numpy as np

from nsaserve.protocol.builder import RequestSpec, build_plan
from nsaserve.protocol.messages import encode_plan, unpack
from nsaserve.worker.executor import NullExecutor
from nsaserve.worker.main import run_plan
from nsaserve.worker.prev_step import PrevStep

PAGE = 4


def executor() -> NullExecutor:
    return NullExecutor(vocab_size=997, num_pages=64, page_size=PAGE, max_context=256)


def prefill(id: int, prompt: list[int], first_page: int) -> RequestSpec:
    return RequestSpec(id=id, input_ids=prompt, cached_len=0, pages=[first_page, first_page + 1, first_page + 2])


def decode(id: int, token: int, cached: int, first_page: int, prev_row: int = -1) -> RequestSpec:
    return RequestSpec(
        id=id,
        input_ids=[-1] if prev_row >= 0 else [token],
        cached_len=cached,
        pages=[first_page, first_page + 1, first_page + 2],
        input_prev_row=prev_row,
    )


def run(step: int, reqs: list[RequestSpec], prev: PrevStep):
    result, _ = run_plan(encode_plan(build_plan(step, PAGE, reqs)), executor(), True, prev)
    return {rid: tok for rid, tok, _ in result.sampled}, dict(result.errors)


def decode_outputs(overlap: bool) -> dict[int, list[int]]:
    """Four decode steps of three requests, inputs given or referenced."""
    prompts = {1: [5, 6, 7], 2: [9, 8], 3: [1, 2, 3, 4, 5]}
    prev = PrevStep(is_rank0=True)
    toks, errs = run(1, [prefill(i, p, 10 * i) for i, p in prompts.items()], prev)
    assert not errs
    outputs = {i: [toks[i]] for i in prompts}
    lens = {i: len(p) for i, p in prompts.items()}
    ids_prev = list(prompts)
    for step in range(2, 6):
        # Rows in a different order each step, so a reference must follow its row.
        ids = sorted(prompts, key=lambda i: (i * step) % 5)
        reqs = []
        for i in ids:
            row = ids_prev.index(i) if overlap else -1
            reqs.append(decode(i, outputs[i][-1], lens[i], 10 * i, row))
        toks, errs = run(step, reqs, prev)
        assert not errs
        for i in ids:
            outputs[i].append(toks[i])
            lens[i] += 1
        ids_prev = ids
    return outputs


def test_references_give_the_tokens_of_given_inputs():
    assert decode_outputs(overlap=True) == decode_outputs(overlap=False)


def test_a_bad_reference_fails_only_its_request():
    prev = PrevStep(is_rank0=True)
    run(
        1,
        [
            prefill(1, [5, 6, 7], 10),
            prefill(2, [9, 8], 20),
            RequestSpec(id=3, input_ids=[4, 4], cached_len=0, pages=[30], sample=False),
        ],
        prev,
    )
    # Row 1 is request 2, not 1; row 2 sampled nothing; row 7 does not exist; row 0 is right.
    toks, errs = run(
        2,
        [
            decode(1, 0, 3, 10, prev_row=1),
            decode(3, 0, 2, 30, prev_row=2),
            decode(4, 0, 2, 40, prev_row=7),
            decode(2, 0, 2, 20, prev_row=1),
        ],
        prev,
    )
    assert set(errs) == {1, 3, 4} and all("input_prev_row" in m for m in errs.values())
    assert set(toks) == {2}


def test_a_reference_needs_the_step_just_before():
    prev = PrevStep(is_rank0=True)
    run(1, [prefill(1, [5, 6, 7], 10)], prev)
    toks, errs = run(3, [decode(1, 0, 3, 10, prev_row=0)], prev)
    assert set(errs) == {1} and not toks
    # An unreadable plan forgets the step before it.
    prev = PrevStep(is_rank0=True)
    run(1, [prefill(1, [5, 6, 7], 10)], prev)
    result, step = run_plan(b"\x00garbage", executor(), True, prev)
    assert step == 0 and prev.last is None


def test_malformed_references_are_per_request_protocol_faults():
    prev = PrevStep(is_rank0=True)
    run(1, [prefill(1, [5, 6, 7], 10), prefill(2, [9, 8], 20)], prev)
    # A reference with a real token instead of -1, and a -1 token without a reference.
    bad_token = RequestSpec(id=1, input_ids=[3], cached_len=3, pages=[10, 11], input_prev_row=0)
    no_ref = RequestSpec(id=2, input_ids=[-1], cached_len=2, pages=[20, 21])
    toks, errs = run(2, [bad_token, no_ref], prev)
    assert set(errs) == {1, 2} and not toks


def test_other_ranks_take_rank0_tokens_through_the_broadcast():
    sent = []

    def broadcast(tokens: np.ndarray, is_rank0: bool) -> np.ndarray:
        sent.append(tokens.copy())
        return np.full_like(tokens, 42)  # what rank 0 sampled, as this rank receives it

    prev = PrevStep(is_rank0=False, broadcast=broadcast)
    plan1 = build_plan(1, PAGE, [prefill(1, [5, 6, 7], 10)])
    run_plan(encode_plan(plan1), executor(), False, prev)
    plan2 = encode_plan(build_plan(2, PAGE, [decode(1, 0, 3, 10, prev_row=0)]))
    result, _ = run_plan(plan2, executor(), False, prev)
    assert len(sent) == 1 and not result.errors
    # The null executor's token is a function of the input: 42 went in.
    assert result.sampled[0][1] == (31 * 42 + 3 + 1) % 997
    assert unpack(plan2)["input_prev_row"]  # the key is on the wire
