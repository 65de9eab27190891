"""Logprobs come from the raw model distribution; prompt logprobs match a row-by-row reference."""

import math

import pytest
import torch

from nsaserve.worker.sampler import SamplingBatch, prompt_logprobs, sample
from nsaserve.worker.sampling_plans import SamplingRequest, make_plan
from nsaserve.worker.sampling_reference import reference_prompt_logprobs

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_token_logprob_is_the_max_log_softmax(device):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 1000, generator=gen).to(device) * 5
    sb = SamplingBatch.from_plan(
        make_plan([SamplingRequest(temperature=0.0, top_logprobs=3) for _ in range(8)]), device
    )
    out = sample(logits, sb)
    lsm = torch.log_softmax(logits, dim=1)
    assert torch.equal(out.tokens, logits.argmax(dim=1))
    torch.testing.assert_close(out.logprobs, lsm.max(dim=1).values)
    assert torch.equal(out.top_ids[:, 0], out.tokens)
    torch.testing.assert_close(out.top_logprobs[:, 0], out.logprobs)


def test_logprobs_ignore_penalties_temperature_and_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    req = SamplingRequest(prompt=[0], temperature=0.0, repetition_penalty=100.0, top_logprobs=4)
    out = sample(logits, SamplingBatch.from_plan(make_plan([req]), "cpu"))
    raw = torch.log_softmax(logits[0], 0)
    assert out.tokens.tolist() == [1]  # the penalty moved the choice off token 0 ...
    assert out.logprobs.item() == pytest.approx(raw[1].item())  # ... but not the reported logprob
    assert out.top_ids[0].tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(out.top_logprobs[0], raw)


def test_top_logprobs_width_is_the_largest_request():
    reqs = [SamplingRequest(top_logprobs=n) for n in (-1, 0, 2, 5)]
    out = sample(torch.randn(4, 50), SamplingBatch.from_plan(make_plan(reqs), "cpu"))
    assert out.top_ids.shape == (4, 5) and out.top_logprobs.shape == (4, 5)
    assert math.isnan(out.logprobs[0].item()) and not out.logprobs[1:].isnan().any()
    assert (out.top_ids[0] == -1).all()
    # Every asking row gets the full K columns, sorted; callers keep the first n.
    assert (out.top_ids[1:] >= 0).all()
    assert (out.top_logprobs[1:, :-1] >= out.top_logprobs[1:, 1:]).all()


def test_top_logprobs_wider_than_the_vocabulary_is_clamped():
    out = sample(torch.randn(1, 3), SamplingBatch.from_plan(make_plan([SamplingRequest(top_logprobs=10)]), "cpu"))
    assert out.top_ids.shape == (1, 3) and sorted(out.top_ids[0].tolist()) == [0, 1, 2]


def test_no_logprobs_asked_gives_an_empty_top():
    out = sample(torch.randn(2, 7), SamplingBatch.from_plan(make_plan([SamplingRequest(), SamplingRequest()]), "cpu"))
    assert out.top_ids.shape == (2, 0) and out.logprobs.isnan().all()


@pytest.mark.parametrize("k", [0, 1, 4])
def test_prompt_logprobs_match_reference_across_chunks(k):
    gen = torch.Generator().manual_seed(k)
    L, V = 23, 300
    logits = torch.randn(L, V, generator=gen) * 3
    nxt = torch.randint(0, V, (L,), generator=gen)
    lp, ids, vals = prompt_logprobs(logits, nxt, k, chunk_rows=5)
    ref_lp, ref_ids, ref_vals = reference_prompt_logprobs(logits, nxt, k)
    assert lp.shape == (L,) and ids.shape == (L, k) and vals.shape == (L, k)
    torch.testing.assert_close(lp.double(), torch.tensor(ref_lp, dtype=torch.float64), rtol=0, atol=1e-5)
    assert ids.tolist() == ref_ids  # random logits: no ties, so the order is defined
    torch.testing.assert_close(
        vals.double(), torch.tensor(ref_vals, dtype=torch.float64).reshape(L, k), rtol=0, atol=1e-5
    )
