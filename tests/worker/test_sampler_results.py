"""Sampler outputs turned into the protocol's result entries."""

import math

import pytest
import torch

from nsaserve.protocol.messages import StepResult
from nsaserve.worker.sampler import SamplingBatch, prompt_logprobs, sample
from nsaserve.worker.sampling_plans import SamplingRequest, make_plan
from nsaserve.worker.sampling_results import prompt_entries, sampled_entries


def test_sampled_entries_follow_the_plan_and_each_requests_width():
    reqs = [
        SamplingRequest(req_id=70, temperature=0.0, top_logprobs=2),
        SamplingRequest(req_id=71, sample=False),
        SamplingRequest(req_id=72, temperature=0.0),
        SamplingRequest(req_id=73, temperature=0.0, top_logprobs=0),
    ]
    plan = make_plan(reqs)
    sb = SamplingBatch.from_plan(plan, "cpu")
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    entries = sampled_entries(plan, sb, sample(logits, sb))
    raw = torch.log_softmax(logits, dim=1)

    assert [(r, t) for r, t, _ in entries] == [(70, 1), (72, 0), (73, 3)]
    first, second, third = (lp for _, _, lp in entries)
    assert first.logprob == pytest.approx(raw[0, 1].item())
    assert [t for t, _ in first.top] == [1, 3] and first.top[1][1] == pytest.approx(raw[0, 3].item())
    assert second is None
    assert third.logprob == pytest.approx(raw[2, 3].item()) and third.top == []
    # The entries encode as a result message.
    assert StepResult(step=1, sampled=entries).encode()


def test_a_step_without_logprobs_gives_tokens_alone():
    reqs = [SamplingRequest(req_id=80, temperature=0.0), SamplingRequest(req_id=81, sample=False),
            SamplingRequest(req_id=82, temperature=0.0)]  # fmt: skip
    plan = make_plan(reqs)
    sb = SamplingBatch.from_plan(plan, "cpu")
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.0, 0.0, 0.0, 1.0]])
    assert sampled_entries(plan, sb, sample(logits, sb)) == [(80, 1, None), (82, 3, None)]


def test_prompt_entries():
    logits = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    entries = prompt_entries(*prompt_logprobs(logits, torch.tensor([0, 1]), 1))
    raw = torch.log_softmax(logits, dim=1)
    assert [e.logprob for e in entries] == pytest.approx([raw[0, 0].item(), raw[1, 1].item()])
    assert [[t for t, _ in e.top] for e in entries] == [[0], [2]]
    assert [e.top[0][1] for e in entries] == pytest.approx([raw[0, 0].item(), raw[1, 2].item()])
    assert not any(math.isnan(e.logprob) for e in entries)
