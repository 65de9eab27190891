"""Plan fuzzing through the worker's own step path (`run_plan`: decode, validate, run), with the
embedded model on the CPU and with the null executor.

Random valid plans are built with the protocol builder, then damaged three ways:
- bytes: truncated or flipped anywhere;
- fields: a key dropped, retyped, or given out-of-range, huge or mis-sized contents;
- one request: pages outside the pool, slots or positions that disagree, huge lengths, token
  ids outside the vocabulary, broken sampling parameters; the others in the plan are intact.
Whatever arrives, `run_plan` returns a result and never raises; every sampling request of a
readable plan gets a token in the vocabulary or an error; and when one request is damaged,
every other request still gets its token, the same one it gets from the plan without the
damaged request (greedy rows). Seeded loops of a fixed length.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import msgpack
import numpy as np
import pytest

from nsaserve.protocol.builder import RequestSpec, SamplingSpec, build_plan, slots_for
from nsaserve.protocol.messages import StepResult, encode_plan
from nsaserve.serve import EMBEDDED_MODEL
from nsaserve.worker.executor import NullExecutor
from nsaserve.worker.main import parse_args, run_plan

PS = 4
POOL = 64  # pages
# Seconds per fuzz loop (each also has a minimum number of cases): the file stays under a minute.
# Plans per fuzz loop, and rounds of every per-request fault: seeded and counted (not timed), so
# a run is repeatable; the file takes well under a minute on two idle cores.
CASES = {"model": 40, "null": 1500}
ROUNDS = {"model": 2, "null": 30}


@pytest.fixture(scope="module")
def model():
    if not (EMBEDDED_MODEL / "config.json").exists():
        pytest.skip("embedded model not built")
    from nsaserve.worker.model_executor import ModelExecutor

    args = parse_args(
        ["--rank=0", "--tp-size=1", f"--model-path={EMBEDDED_MODEL}", f"--num-pages={POOL}", f"--page-size={PS}"]
    )
    return ModelExecutor.from_args(args)


@pytest.fixture(scope="module")
def null():
    return NullExecutor(vocab_size=640, num_pages=POOL, page_size=PS, max_context=4096)


def random_specs(rng: random.Random, vocab: int, n: int | None = None) -> list[RequestSpec]:
    """1-5 well-formed requests on disjoint pages: prefill chunks, cached prefixes, decodes."""
    free = list(range(POOL))
    rng.shuffle(free)
    specs = []
    for rid in range(1, 1 + (n or rng.randint(1, 5))):
        qlen = rng.choice([1, 1, rng.randint(2, 12)])
        cached = rng.choice([0, rng.randint(0, 20)])
        pages = [free.pop() for _ in range(-(-(cached + qlen) // PS))]
        history = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        sampling = SamplingSpec(
            temperature=rng.choice([0.0, 0.0, 0.7]),
            top_k=rng.choice([0, 5]),
            top_p=rng.choice([1.0, 0.9]),
            repetition_penalty=rng.choice([1.0, 1.2]) if history else 1.0,
            seed=rng.choice([None, rng.randrange(2**32)]),
            top_logprobs=rng.choice([None, 0, 3]),
        )
        specs.append(
            RequestSpec(
                rid,
                [rng.randrange(vocab) for _ in range(qlen)],
                cached,
                pages,
                sample=rng.random() < 0.9,
                prompt_logprobs=qlen > 1 and rng.random() < 0.2,
                sampling=sampling,
                history=history,
                history_prompt_len=len(history) // 2,
            )
        )
    return specs


def check_result(result: StepResult | None, sampling_ids: set[int], vocab: int) -> dict[int, int]:
    """Every sampling request got a token in the vocabulary or an error (the router turns a
    missing one into an error too, but a worker that reads the plan should answer for all)."""
    assert isinstance(result, StepResult)
    tokens = {}
    for rid, tok, lp in result.sampled:
        assert 0 <= tok < vocab, (rid, tok)
        if lp is not None:
            assert math.isnan(lp.logprob) or lp.logprob <= 1e-4
        tokens[rid] = tok
    failed = {rid for rid, _ in result.errors}
    if result.step != 0:  # a readable plan
        assert sampling_ids <= set(tokens) | failed, (sampling_ids, tokens, result.errors)
    return tokens


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    if rng.random() < 0.3:
        return data[: rng.randrange(len(data))]
    b = bytearray(data)
    for _ in range(rng.randint(1, 12)):
        b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


GARBAGE = [None, True, -1, 0, 2**31, 2**63, 2**64 - 1, -(2**63), 1.5, math.nan, "x", "", [1, 2], {"a": 1}, b"", b"\x01"]


def mutate_field(data: bytes, rng: random.Random) -> bytes:
    msg = msgpack.unpackb(data, raw=False)
    key = rng.choice(list(msg))
    roll = rng.random()
    if roll < 0.2:
        del msg[key]
    elif roll < 0.5:
        msg[key] = rng.choice(GARBAGE)
    elif isinstance(msg[key], bytes) and len(msg[key]) >= 4:
        # Plausible-looking contents of the wrong length or range, or the right length with
        # huge or negative values.
        width = 8 if key in ("req_ids", "seed") else 1 if key in ("sample", "has_seed", "prompt_logprobs") else 4
        count = len(msg[key]) // width
        if rng.random() < 0.5:
            count = rng.choice([0, max(0, count - 1), count + 1, count * 3])
        vals = [rng.choice([0, 1, -1, 7, 2**31 - 1, -(2**31), rng.randrange(-100, 100)]) for _ in range(count)]
        fmt = {8: "<i8", 4: "<i4", 1: "<i1"}[width]
        msg[key] = np.array(vals, dtype=np.int64).astype(fmt).tobytes()
    else:
        msg[key] = rng.choice(GARBAGE)
    return msgpack.packb(msg, use_bin_type=True)


def mutate_payload(data: bytes, rng: random.Random) -> bytes:
    """Flipped bytes inside one array: the plan still decodes, with wrong values in it."""
    msg = msgpack.unpackb(data, raw=False)
    key = rng.choice([k for k, v in msg.items() if isinstance(v, bytes) and v])
    b = bytearray(msg[key])
    for _ in range(rng.randint(1, 4)):
        b[rng.randrange(len(b))] = rng.randrange(256)
    msg[key] = bytes(b)
    return msgpack.packb(msg, use_bin_type=True)


def fuzz_loop(executor, rng: random.Random, mutate, cases: int) -> dict[str, int]:
    outcomes = {"unreadable": 0, "ran": 0}
    for _ in range(cases):
        specs = random_specs(rng, executor.vocab_size)
        data = mutate(encode_plan(build_plan(rng.randint(1, 10**6), PS, specs)), rng)
        result, step = run_plan(data, executor, True)
        check_result(result, set(), executor.vocab_size)
        outcomes["unreadable" if result.step == 0 else "ran"] += 1
    return outcomes


MUTATIONS = {"bytes": mutate_bytes, "fields": mutate_field, "payload": mutate_payload}


@pytest.mark.parametrize("kind", list(MUTATIONS))
def test_damaged_plans_never_crash_the_model_worker(model, kind):
    outcomes = fuzz_loop(model, random.Random(7), MUTATIONS[kind], cases=CASES["model"])
    # Raw bytes and fields mostly break the framing or a shape; payload damage mostly reaches
    # the per-request checks and the model.
    least_ran = {"bytes": 0, "fields": 1, "payload": CASES["model"] // 2}[kind]
    assert outcomes["unreadable"] > 0 and outcomes["ran"] >= least_ran, outcomes


@pytest.mark.parametrize("kind", list(MUTATIONS))
def test_damaged_plans_never_crash_the_null_worker(null, kind):
    outcomes = fuzz_loop(null, random.Random(11), MUTATIONS[kind], cases=CASES["null"])
    assert outcomes["unreadable"] > 20 and outcomes["ran"] > 20, outcomes


# ------------------------------------------------------------------ one damaged request

HUGE = 2**31 - 1


def damage(spec: RequestSpec, how: str, rng: random.Random, vocab: int) -> RequestSpec:
    """`spec` with one fault that concerns it alone."""
    s = spec.sampling
    # The slots it writes stay those of the intact request unless the fault is in them.
    spec = replace(spec, out_slots=slots_for(spec.cached_len, len(spec.input_ids), spec.pages, PS))
    if how == "page outside the pool":
        pages = list(spec.pages)
        pages[rng.randrange(len(pages))] = rng.choice([POOL, POOL + 7, HUGE, -1])
        return replace(spec, pages=pages)
    if how == "too few pages":
        return replace(spec, pages=list(spec.pages)[:-1])
    if how == "huge cached_len":
        return replace(spec, cached_len=rng.choice([HUGE - len(spec.input_ids), 10**9]))
    if how == "negative cached_len":
        return replace(spec, cached_len=-rng.randint(1, HUGE))
    if how == "slot off its page table":
        good = list(spec.out_slots)
        good[rng.randrange(len(good))] = rng.choice([POOL * PS + 3, -5, HUGE])
        return replace(spec, out_slots=good)
    if how == "token outside the vocabulary":
        ids = list(spec.input_ids)
        ids[rng.randrange(len(ids))] = rng.choice([vocab, vocab + 1000, HUGE, -1, -HUGE])
        return replace(spec, input_ids=ids)
    if how == "history outside the vocabulary":
        history = [rng.choice([vocab, HUGE, -3])] + list(spec.history)
        return replace(
            spec,
            history=history,
            history_prompt_len=1,
            sampling=replace(s, repetition_penalty=1.3, presence_penalty=0.5),
        )
    if how == "history_prompt_len out of range":
        # Beyond the history is checkable only when the plan sends the whole history (a reset).
        return replace(spec, history_prompt_len=rng.choice([len(spec.history) + 1, -1, HUGE]), history_reset=True)
    if how == "broken sampling numbers":
        return replace(
            spec,
            sampling=SamplingSpec(
                temperature=rng.choice([math.nan, math.inf, -1.0, 1e-30, 1e30]),
                top_p=rng.choice([math.nan, -1.0, 0.0, 5.0]),
                top_k=rng.choice([-HUGE, HUGE, 10**6]),
                min_p=rng.choice([math.nan, -1.0, 2.0]),
                repetition_penalty=rng.choice([math.nan, 0.0, -2.0, 1e30]),
                frequency_penalty=rng.choice([math.nan, math.inf, -1e30]),
                presence_penalty=rng.choice([math.nan, -math.inf, 1e30]),
                seed=rng.choice([None, 2**64 - 1]),
                top_logprobs=rng.choice([None, 0, 10**6, HUGE]),
            ),
            history=list(spec.history) or [1, 2],
            history_prompt_len=0,
        )
    raise AssertionError(how)


FAULTS = [
    "page outside the pool",
    "too few pages",
    "huge cached_len",
    "negative cached_len",
    "slot off its page table",
    "token outside the vocabulary",
    "history outside the vocabulary",
    "history_prompt_len out of range",
    "broken sampling numbers",
]
# Faults that leave the request well-formed enough to run: it may get a token (in the
# vocabulary) instead of an error.
RUNNABLE = {"broken sampling numbers"}


@pytest.mark.parametrize("executor_name", ["model", "null"])
def test_one_damaged_request_fails_alone(executor_name, request):
    executor = request.getfixturevalue(executor_name)
    vocab = executor.vocab_size
    rng = random.Random(5)
    for _ in range(ROUNDS[executor_name]):
        for how in FAULTS:
            specs = random_specs(rng, vocab, n=rng.randint(2, 5))
            for s in specs:  # every request samples, greedily, so survivors can be compared
                s.sample, s.prompt_logprobs = True, False
                s.sampling = replace(s.sampling, temperature=0.0)
            victim = rng.randrange(len(specs))
            others = [s for i, s in enumerate(specs) if i != victim]
            clean, _ = run_plan(encode_plan(build_plan(1, PS, others)), executor, True)
            want = check_result(clean, {s.id for s in others}, vocab)
            assert not clean.errors and len(want) == len(others)

            damaged = list(specs)
            damaged[victim] = damage(specs[victim], how, rng, vocab)
            result, _ = run_plan(encode_plan(build_plan(2, PS, damaged)), executor, True)
            got = check_result(result, {s.id for s in specs}, vocab)
            failed = {rid for rid, _ in result.errors}
            victim_id = specs[victim].id
            assert failed <= {victim_id}, (how, result.errors)
            assert victim_id in failed or how in RUNNABLE, (how, result)
            # The intact requests ran as if the damaged one were not there.
            assert {rid: t for rid, t in got.items() if rid != victim_id} == want, how
