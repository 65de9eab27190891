"""Penalty histories held on rank 0 (worker/penalty_history.py): plans that send a request's whole
history once and then only what is new must give the sampler exactly what plans sending the
whole history every step give it. The slow reference is the whole-history plan itself."""

from __future__ import annotations

import numpy as np
import torch

from nsaserve.protocol.builder import RequestSpec, SamplingSpec, build_plan
from nsaserve.worker.penalty_history import PenaltyHistories
from nsaserve.worker.sampler import SamplingBatch, sample

PS = 4
PENALISED = SamplingSpec(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)


def spec(i: int, history, prompt_len: int, reset: bool | None, sampling=PENALISED) -> RequestSpec:
    return RequestSpec(i, [3], 6, [2 * i, 2 * i + 1], sampling=sampling, history=history, history_prompt_len=prompt_len,
                       history_reset=reset)  # fmt: skip


def test_deltas_rebuild_the_whole_histories_step_after_step():
    rng = np.random.default_rng(0)
    whole = {i: rng.integers(0, 50, 5 + i).tolist() for i in range(4)}
    prompt = {i: 3 + i % 2 for i in whole}
    held = PenaltyHistories()
    vocab = 50
    sent: dict[int, int] = {}
    for step in range(1, 9):
        ids = [i for i in whole if (i + step) % 5]  # requests come and go from the batch
        # The reference: every plan carries each request's whole history.
        full = build_plan(step, PS, [spec(i, whole[i], prompt[i], True) for i in ids])
        if step == 1:
            delta = full
        else:
            delta = build_plan(step, PS, [spec(i, whole[i][sent[i]:], prompt[i], False) for i in ids])
        got, errors = held.resolve(delta)
        assert errors == []
        assert got.history_start.tolist() == full.history_start.tolist()
        assert got.history.tolist() == full.history.tolist()
        logits = torch.randn(len(ids), vocab, generator=torch.Generator().manual_seed(step))
        a = sample(logits.clone(), SamplingBatch.from_plan(got, "cpu")).tokens
        b = sample(logits.clone(), SamplingBatch.from_plan(full, "cpu")).tokens
        assert torch.equal(a, b)
        sent.update({i: len(whole[i]) for i in ids})  # what the worker now holds
        for i in ids:  # each request that ran generated a token (and some generate two)
            whole[i] = whole[i] + rng.integers(0, vocab, 1 + (i == 2)).tolist()


def test_a_pending_step_sends_nothing_and_a_reset_replaces():
    held = PenaltyHistories()
    held.resolve(build_plan(1, PS, [spec(1, [4, 5, 6], 2, True)]))
    got, _ = held.resolve(build_plan(2, PS, [spec(1, [], 2, False)]))  # planned ahead: nothing new known
    assert got.history.tolist() == [4, 5, 6]
    got, _ = held.resolve(build_plan(3, PS, [spec(1, [9, 9], 2, True)]))  # e.g. after the worker restarted
    assert got.history.tolist() == [9, 9]


def test_released_histories_go_and_extending_an_unknown_one_fails_only_that_request():
    held = PenaltyHistories()
    held.resolve(build_plan(1, PS, [spec(1, [4, 5], 1, True), spec(2, [7], 1, True)]))
    assert len(held) == 2
    got, errors = held.resolve(build_plan(2, PS, [spec(2, [8], 1, False), spec(3, [1], 1, False)], released=[1, 99]))
    assert len(held) == 1  # 1 dropped; 99 was never held; 3 extended nothing it could
    assert [r for r, _ in errors] == [3] and "does not hold" in errors[0][1]
    assert got.history.tolist() == [7, 8]  # request 3's penalties see nothing (its token is dropped)
    assert got.history_start.tolist() == [0, 2, 2]


def test_requests_without_penalties_hold_nothing():
    held = PenaltyHistories()
    plain = SamplingSpec(temperature=0.7)
    got, errors = held.resolve(build_plan(1, PS, [spec(1, [], 0, None, plain), spec(2, [4], 1, None)]))
    assert errors == [] and len(held) == 1 and got.history.tolist() == [4]
