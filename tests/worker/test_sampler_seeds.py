"""Seeded requests draw the same token whatever they are batched with."""

import random

import pytest
import torch

from nsaserve.worker.sampler import SamplingBatch, sample
from nsaserve.worker.sampling_plans import SamplingRequest, make_plan

V = 500
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def seeded_request(**kw) -> SamplingRequest:
    return SamplingRequest(
        prompt=list(range(30)), generated=[7, 8], seed=1234567, temperature=1.3, top_p=0.95, top_k=200, **kw
    )


def others(rng: random.Random, n: int) -> list[SamplingRequest]:
    out = []
    for _ in range(n):
        out.append(
            SamplingRequest(
                prompt=[rng.randrange(V) for _ in range(rng.randint(1, 20))],
                temperature=rng.choice([0.0, 0.8, 1.0]),
                top_p=rng.choice([1.0, 0.9]),
                seed=rng.choice([None, rng.randrange(1000)]),
                repetition_penalty=rng.choice([1.0, 1.2]),
                sample=rng.random() < 0.9,
            )
        )
    return out


def token_of(
    target: SamplingRequest,
    before: list[SamplingRequest],
    after: list[SamplingRequest],
    row_logits: torch.Tensor,
    gen_seed: int,
    device: str = "cpu",
) -> int:
    plan = make_plan(before + [target] + after)
    sb = SamplingBatch.from_plan(plan, device)
    gen = torch.Generator(device).manual_seed(gen_seed)
    logits = torch.randn(sb.num_rows, V, generator=gen, device=device) * 4
    row = int(plan.sample[: len(before)].sum())
    logits[row] = row_logits.to(device)
    return sample(logits, sb, gen).tokens[row].item()


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_token_is_independent_of_the_batch(device):
    rng = random.Random(0)
    row_logits = torch.randn(V, generator=torch.Generator().manual_seed(1))  # flat enough that noise decides
    alone = token_of(seeded_request(), [], [], row_logits, 0, device)
    for trial in range(12):
        before, after = others(rng, rng.randint(0, 40)), others(rng, rng.randint(0, 40))
        assert token_of(seeded_request(), before, after, row_logits, 100 + trial, device) == alone


def test_seeded_token_depends_only_on_the_position_not_on_the_chunking():
    # A chunked prefill that ends the prompt and a decode step at the same position draw the same.
    row_logits = torch.randn(V, generator=torch.Generator().manual_seed(2))
    chunk = token_of(seeded_request(query_len=17), [], [], row_logits, 0)
    decode = token_of(seeded_request(query_len=1), others(random.Random(3), 5), [], row_logits, 1)
    assert chunk == decode


def test_seed_and_position_both_change_the_draw():
    row_logits = torch.zeros(V)  # uniform: the token is the noise's argmax
    base = seeded_request()
    tokens_by_pos = set()
    for extra in range(8):
        r = seeded_request()
        r.generated = base.generated + [1] * extra
        tokens_by_pos.add(token_of(r, [], [], row_logits, 0))
    tokens_by_seed = set()
    for s in range(8):
        r = seeded_request()
        r.seed = s
        tokens_by_seed.add(token_of(r, [], [], row_logits, 0))
    # 8 draws over 200 equally likely tokens: all distinct unless the noise ignored the input.
    assert len(tokens_by_pos) >= 6 and len(tokens_by_seed) >= 6


def test_unseeded_rows_follow_the_given_generator():
    plan = make_plan([SamplingRequest(temperature=1.0) for _ in range(16)])
    sb = SamplingBatch.from_plan(plan, "cpu")
    logits = torch.zeros(16, V)
    a = sample(logits, sb, torch.Generator().manual_seed(5)).tokens
    b = sample(logits, sb, torch.Generator().manual_seed(5)).tokens
    c = sample(logits, sb, torch.Generator().manual_seed(6)).tokens
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_seeded_noise_is_the_same_on_every_device():
    """The uniforms are integer arithmetic (Philox), so a seed draws the same noise on the CPU and
    on a GPU: the same token wherever the logits agree."""
    from nsaserve.worker.sampling_noise import seeded_uniform

    cpu = seeded_uniform(0xDEADBEEF12345678, V, "cpu")
    assert cpu.shape == (V,) and bool(((cpu >= 0) & (cpu < 1)).all())
    for device in DEVICES[1:]:
        assert torch.equal(seeded_uniform(0xDEADBEEF12345678, V, device).cpu(), cpu)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_queues_behind_running_kernels():
    """Building the batch and sampling it (seeds, penalties, filters, logprobs) only queue work: the
    host never waits for the kernels queued before it, so the worker can launch the next step
    while this one runs."""
    rng = random.Random(0)
    reqs = others(rng, 40) + [seeded_request(frequency_penalty=0.3, top_logprobs=3)]
    plan = make_plan(reqs)
    logits = torch.randn(int(plan.sample.sum()), V, device="cuda")
    sample(logits, SamplingBatch.from_plan(plan, "cuda"))  # builds the kernels: compiling takes host time
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    busy = torch.cuda.Event()
    busy.record()
    out = sample(logits, SamplingBatch.from_plan(plan, "cuda"))
    assert not busy.query(), "the sampler waited for the kernel queued before it"
    assert out.tokens.shape == (logits.shape[0],)
