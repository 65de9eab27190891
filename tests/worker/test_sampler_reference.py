"""The vectorised sampler against the per-request reference on random batches."""

import math
import random

import numpy as np
import pytest
import torch

from nsaserve.protocol.validate import validate_plan
from nsaserve.worker.sampler import SamplingBatch, draw_uniform, pick_tokens, plain_sampling, sample
from nsaserve.worker.sampling_logits import process_logits
from nsaserve.worker.sampling_noise import seeded_uniform
from nsaserve.worker.sampling_plans import SamplingRequest, make_plan
from nsaserve.worker.sampling_reference import reference_sample

# Every path runs on CPU; the CUDA path is checked against the same reference where there is a GPU.
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def random_request(rng: random.Random, vocab: int) -> SamplingRequest:
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
    generated = [rng.randrange(vocab) for _ in range(rng.choice([0, 0, 3, 25]))]
    r = SamplingRequest(
        prompt=prompt,
        generated=generated,
        query_len=rng.randint(1, len(prompt) + len(generated)),
        sample=rng.random() < 0.85,
        temperature=rng.choice([0.0, 1e-6, 0.3, 0.7, 1.0, 1.6]),
        top_k=rng.choice([0, -1, 1, 2, 7, 50, vocab, vocab + 10]),
        top_p=rng.choice([1.0, 1.0, 0.95, 0.7, 0.3, 0.0, rng.random()]),
        min_p=rng.choice([0.0, 0.0, 0.02, 0.2, 1.0]),
        seed=rng.choice([None, None, rng.randrange(2**64)]),
        top_logprobs=rng.choice([-1, -1, 0, 1, 5]),
    )
    if rng.random() < 0.3:  # logit_bias: large enough to move the choice, small enough to leave ties out
        r.logit_bias = {
            t: rng.choice([-100.0, -3.5, 2.25, 7.0, 100.0]) for t in rng.sample(range(vocab), rng.randint(1, 6))
        }
    if r.sample and rng.random() < 0.25:  # structured output: a few allowed tokens, or many
        r.allowed = sorted(rng.sample(range(vocab), rng.choice([1, 2, 5, vocab // 2])))
    if rng.random() < 0.4:
        r.repetition_penalty = rng.choice([1.0, 0.7, 1.3, 2.0])
        r.frequency_penalty = rng.choice([0.0, 0.5, -0.4])
        r.presence_penalty = rng.choice([0.0, 0.8, -0.3])
    return r


def random_case(seed: int, all_top_k: bool = False):
    rng = random.Random(seed)
    vocab = rng.choice([64, 257, 1000])
    reqs = [random_request(rng, vocab) for _ in range(rng.randint(1, 24))]
    if all_top_k:  # no row without top-k: top-p then runs on the top-k candidates, not a full sort
        for r in reqs:
            r.top_k = rng.choice([1, 2, 7, 50])
    plan = make_plan(reqs)
    gen = torch.Generator().manual_seed(seed)
    S = int(plan.sample.sum())
    logits = torch.randn(S, vocab, generator=gen) * rng.choice([1.0, 3.0, 8.0])
    return plan, logits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("all_top_k", [False, True])
def test_random_batches_match_reference(seed, all_top_k, device):
    plan, logits = random_case(seed, all_top_k)
    assert validate_plan(plan, num_pages=10**6)[1] == []
    sb = SamplingBatch.from_plan(plan, device)
    gen = torch.Generator(device).manual_seed(1000 + seed)
    u = draw_uniform(sb, logits.shape[1], device, gen)
    u = torch.rand(logits.shape, generator=gen, device=device) if u is None else u
    x = process_logits(logits.to(device), sb)
    tokens = pick_tokens(x, u, sb)
    ref = reference_sample(logits, plan, u.cpu())
    assert tokens.tolist() == [r.token for r in ref]

    greedy = sb.greedy.tolist()
    x = x.cpu()
    probs = torch.softmax(x, dim=1).double()
    for j, r in enumerate(ref):
        if greedy[j]:
            continue
        # Same support exactly, same renormalised probabilities to float32 accuracy.
        assert torch.equal(x[j] > float("-inf"), r.probs > 0), f"row {j}: filters kept different tokens"
        torch.testing.assert_close(probs[j], r.probs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(40, 60))
def test_sample_end_to_end_matches_reference_on_seeded_rows(seed, device):
    """`sample` itself (its own noise) agrees with the reference wherever the noise is known: seeded rows."""
    plan, logits = random_case(seed)
    sb = SamplingBatch.from_plan(plan, device)
    out = sample(logits.to(device), sb)
    V = logits.shape[1]
    u = torch.rand(logits.shape)  # unseeded rows: any noise; only seeded and greedy rows are compared
    for row, gen_seed in sb.seeded:
        u[row] = seeded_uniform(gen_seed, V, device).cpu()
    ref = reference_sample(logits, plan, u)
    check = {row for row, _ in sb.seeded} | set(np.flatnonzero(sb.greedy.cpu().numpy()).tolist())
    for j in sorted(check):
        assert out.tokens[j].item() == ref[j].token


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(60, 80))
def test_logprobs_match_reference(seed, device):
    plan, logits = random_case(seed)
    sb = SamplingBatch.from_plan(plan, device)
    out = sample(logits.to(device), sb)
    out = type(out)(*(t.cpu() for t in (out.tokens, out.logprobs, out.top_ids, out.top_logprobs)))
    # Reference given the tokens actually sampled: logprobs describe the raw model.
    lsm = torch.log_softmax(logits.double(), dim=1)
    asked = plan.top_logprobs[plan.sample.astype(bool)]
    K = out.top_ids.shape[1]
    assert K == max([0, *asked.tolist()])
    for j, n in enumerate(asked.tolist()):
        if n < 0:
            assert math.isnan(out.logprobs[j].item())
            assert (out.top_ids[j] == -1).all() and out.top_logprobs[j].isnan().all()
            continue
        assert out.logprobs[j].item() == pytest.approx(lsm[j, out.tokens[j]].item(), abs=1e-5)
        want = lsm[j].sort(descending=True).values[:n]
        torch.testing.assert_close(out.top_logprobs[j, :n].double(), want, rtol=0, atol=1e-5)
        # Each returned id carries its own logprob.
        torch.testing.assert_close(lsm[j, out.top_ids[j, :n]], out.top_logprobs[j, :n].double(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(60, 72))
def test_plain_batches_fold_the_temperature_into_the_pick(seed, device):
    """Batches with no penalty or filter (temperature, greedy and seeded rows only): the pick divides
    the raw logits itself, and picks the tokens of dividing first and of the float64 reference."""
    rng = random.Random(seed)
    vocab = rng.choice([257, 1000])
    reqs = [random_request(rng, vocab) for _ in range(rng.randint(1, 24))]
    for r in reqs:
        r.top_k, r.top_p, r.min_p = 0, 1.0, 0.0
        r.repetition_penalty, r.frequency_penalty, r.presence_penalty = 1.0, 0.0, 0.0
        r.logit_bias, r.allowed = {}, None
    plan = make_plan(reqs)
    sb = SamplingBatch.from_plan(plan, device)
    assert plain_sampling(sb)
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(sb.num_rows, vocab, generator=gen) * 3).to(device)
    u = torch.rand(logits.shape, generator=gen).to(device)
    folded = pick_tokens(logits, u, sb, temperature=sb.temperature)
    assert torch.equal(folded, pick_tokens(process_logits(logits, sb), u, sb))
    assert folded.tolist() == [r.token for r in reference_sample(logits.cpu(), plan, u.cpu())]
    out = sample(logits, sb)  # the sampler's own path takes the fold here
    x = process_logits(logits, sb)
    for row, gen_seed in sb.seeded:
        noise = seeded_uniform(gen_seed, vocab, device).expand(sb.num_rows, -1)
        assert out.tokens[row].item() == pick_tokens(x, noise, sb)[row].item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(80, 92))
@pytest.mark.parametrize("plain", [False, True])
def test_bf16_logits_sample_as_their_float32_copy(seed, plain, device):
    """Decode graphs hand the sampler lm_head's bf16 rows, not a float32 copy of them: every path
    (the pick dividing by the temperature itself, penalties and filters, greedy rows, logprobs)
    gives the same tokens and the same numbers as on the exact float32 upcast, with the same noise."""
    rng = random.Random(seed)
    vocab = rng.choice([257, 1000])
    reqs = [random_request(rng, vocab) for _ in range(rng.randint(1, 24))]
    if plain:
        for r in reqs:
            r.top_k, r.top_p, r.min_p = 0, 1.0, 0.0
            r.repetition_penalty, r.frequency_penalty, r.presence_penalty = 1.0, 0.0, 0.0
            r.logit_bias, r.allowed = {}, None
    plan = make_plan(reqs)
    sb = SamplingBatch.from_plan(plan, device)
    assert plain_sampling(sb) or not plain
    gen = torch.Generator().manual_seed(seed)
    rows = (torch.randn(sb.num_rows, vocab, generator=gen) * 3).bfloat16().to(device)
    got = sample(rows, sb, torch.Generator(device).manual_seed(seed))
    want = sample(rows.float(), sb, torch.Generator(device).manual_seed(seed))
    for field in ("tokens", "logprobs", "top_ids", "top_logprobs"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and torch.equal(a.nan_to_num(nan=-7.0), b.nan_to_num(nan=-7.0)), field


def test_filters_and_penalties_are_not_plain():
    rng = random.Random(5)
    base = dict(top_k=0, top_p=1.0, min_p=0.0)
    changes = ({"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}, {"repetition_penalty": 1.3}, {"logit_bias": {3: 1.0}}, {"allowed": [1, 2]}, {})
    for change in changes:
        reqs = [random_request(rng, 100) for _ in range(3)]
        for r in reqs:
            r.temperature, r.sample = 0.7, True
            r.repetition_penalty, r.frequency_penalty, r.presence_penalty = 1.0, 0.0, 0.0
            r.logit_bias, r.allowed = {}, None
            for k, v in {**base, **change}.items():
                setattr(r, k, v)
        sb = SamplingBatch.from_plan(make_plan(reqs), "cpu")
        assert plain_sampling(sb) == (change == {}), change


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_without_adjustments_read_bf16_logits_as_they_are(device):
    """An all-greedy batch with no bias or penalty samples from the logits as given (the decode
    graphs' bf16 rows, no float32 copy): the same tokens as the float32 path, ties to the lowest
    id included; a penalised greedy batch still gets its float32 copy."""
    gen = torch.Generator().manual_seed(3)
    vocab, rows = 1000, 12
    # Few distinct values, so that many rows hold ties for their maximum.
    logits = (torch.randint(-4, 5, (rows, vocab), generator=gen) * 0.5).to(torch.bfloat16).to(device)
    plain = SamplingBatch.from_plan(make_plan([SamplingRequest(prompt=[1, 2], temperature=0.0)] * rows), device)
    assert process_logits(logits, plain) is logits
    tokens = sample(logits, plain).tokens
    assert torch.equal(tokens, logits.float().argmax(dim=1))
    assert tokens.tolist() == [int(torch.nonzero(r == r.max())[0]) for r in logits.float().cpu()]
    penalised = [SamplingRequest(prompt=[1, 2], temperature=0.0, repetition_penalty=1.5)] * rows
    pb = SamplingBatch.from_plan(make_plan(penalised), device)
    assert process_logits(logits, pb).dtype == torch.float32
