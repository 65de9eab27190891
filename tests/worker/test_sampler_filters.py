"""Greedy, penalties and top-k/top-p/min-p on small hand-checked examples."""

import random

import pytest
import torch

from nsaserve.worker.sampler import SamplingBatch, sample
from nsaserve.worker.sampling_logits import apply_bias_and_penalties, process_logits
from nsaserve.worker.sampling_plans import SamplingRequest, make_plan
from nsaserve.worker.sampling_reference import reference_penalties

NEG = float("-inf")
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def batch(*reqs: SamplingRequest) -> SamplingBatch:
    return SamplingBatch.from_plan(make_plan(list(reqs)), "cpu")


def kept(logits, **params) -> list[int]:
    """Token ids a single request's filters keep."""
    x = process_logits(torch.tensor([logits]), batch(SamplingRequest(**params)))
    return torch.nonzero(x[0] > NEG).flatten().tolist()


def test_penalties_known_example():
    # prompt [0, 1], generated [2, 2, 3]; repetition 2 on {0,1,2,3}, then frequency 0.5 and
    # presence 0.25 on the generated counts {2: 2, 3: 1}; token 4 is untouched.
    sb = batch(
        SamplingRequest(
            prompt=[0, 1], generated=[2, 2, 3], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
        )
    )
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    out = apply_bias_and_penalties(logits, sb)
    assert out.tolist() == [[1.0, -2.0, 0.25 - 1.0 - 0.25, -6.0 - 0.5 - 0.25, 1.0]]
    assert logits.tolist() == [[2.0, -1.0, 0.5, -3.0, 1.0]]  # the caller's logits are untouched


def test_logit_bias_is_added_before_the_penalties():
    # Token 2: 0.5 + 1.5 = 2.0, then repetition 2 (positive: / 2) = 1.0, then frequency 0.5 for
    # one generated occurrence: 0.5. Token 4 (no history): 1.0 - 100. Token 0 untouched.
    sb = batch(
        SamplingRequest(
            prompt=[1], generated=[2], repetition_penalty=2.0, frequency_penalty=0.5, logit_bias={2: 1.5, 4: -100.0}
        ),
        SamplingRequest(prompt=[1], logit_bias={0: 3.0}),
    )
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    out = apply_bias_and_penalties(logits, sb)
    assert out.tolist() == [[2.0, -2.0, 0.5, -3.0, -99.0], [3.0, 1.0, 2.0, 3.0, 4.0]]


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_steers_greedy_and_sampled_rows(device):
    logits = torch.zeros(3, 50, device=device)
    logits[:, 7] = 5.0
    plan = make_plan(
        [
            SamplingRequest(temperature=0.0, logit_bias={31: 100.0}),  # greedy: the forced token
            SamplingRequest(temperature=1.0, logit_bias={7: -100.0, **{t: -100.0 for t in range(0, 50, 2)}}),
            SamplingRequest(temperature=0.0, top_logprobs=1, logit_bias={7: -100.0}),
        ]
    )
    out = sample(logits, SamplingBatch.from_plan(plan, device))
    assert out.tokens[0].item() == 31
    assert out.tokens[1].item() % 2 == 1 and out.tokens[1].item() != 7  # banned tokens never come
    assert out.tokens[2].item() != 7
    # Logprobs stay the raw model's: token 7 is still the most likely there.
    assert out.top_ids[2, 0].item() == 7


def test_frequency_and_presence_ignore_prompt_tokens():
    sb = batch(SamplingRequest(prompt=[0, 0, 1], generated=[1], frequency_penalty=1.0, presence_penalty=0.5))
    out = apply_bias_and_penalties(torch.zeros(1, 3), sb)
    assert out.tolist() == [[0.0, -1.5, 0.0]]


def test_penalties_only_touch_their_own_rows():
    sb = batch(
        SamplingRequest(prompt=[0], generated=[1]),
        SamplingRequest(prompt=[2], generated=[3, 3], repetition_penalty=1.5, frequency_penalty=1.0),
        SamplingRequest(prompt=[1], generated=[1]),
    )
    logits = torch.full((3, 5), 3.0)
    out = apply_bias_and_penalties(logits, sb)
    assert out[0].tolist() == [3.0] * 5 and out[2].tolist() == [3.0] * 5
    assert out[1].tolist() == [3.0, 3.0, 2.0, 2.0 - 2.0, 3.0]


def test_penalties_on_bf16_rows_compute_in_float32():
    """Decode graphs hand over bf16 rows: the penalties see them as float32 (the same result as on
    their float32 copy, bit for bit) and return float32, penalised rows or not."""
    sb = batch(
        SamplingRequest(prompt=[0, 5], generated=[5, 7], repetition_penalty=1.3, frequency_penalty=0.37),
        SamplingRequest(temperature=0.5),
    )
    logits = (torch.randn(2, 11, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    out = apply_bias_and_penalties(logits, sb)
    assert out.dtype == torch.float32 and torch.equal(out, apply_bias_and_penalties(logits.float(), sb))
    assert apply_bias_and_penalties(logits, batch(SamplingRequest())).dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(4))
def test_penalties_match_the_per_request_reference_on_random_histories(device, seed):
    """Random batches: long histories with many repeats, ids outside the vocabulary, rows with and
    without penalties, bf16 and float32 logits. Penalised logits match the per-request float64
    reference to float32 rounding; every logit no penalty touches comes through bit for bit."""
    rng = random.Random(seed)
    V = rng.choice([7, 50, 300])
    reqs = []
    for _ in range(rng.randint(1, 9)):
        r = SamplingRequest(
            prompt=[rng.randrange(-2, V + 3) for _ in range(rng.randint(1, 40))],
            generated=[rng.randrange(-2, V + 3) for _ in range(rng.randint(0, 40))],
        )
        if rng.random() < 0.7:
            r.repetition_penalty = rng.choice([1.0, 0.8, 1.3, 2.0])
            r.frequency_penalty = rng.choice([0.0, 0.5, -0.3, 1.7])
            r.presence_penalty = rng.choice([0.0, 0.25, -1.0])
        reqs.append(r)
    plan = make_plan(reqs)
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(len(reqs), V, generator=g) * 4).to(rng.choice([torch.float32, torch.bfloat16]))
    out = apply_bias_and_penalties(logits.to(device), SamplingBatch.from_plan(plan, device)).cpu()
    assert out.dtype == torch.float32
    for i, r in enumerate(reqs):
        want = reference_penalties(logits[i].float(), plan, i).float()
        touched = {t for t in r.prompt + r.generated if 0 <= t < V} if r.needs_history() else set()
        for t in range(V):
            if t in touched:
                assert torch.isclose(out[i, t], want[t], rtol=1e-6, atol=1e-6), (i, t, out[i, t], want[t])
            else:
                assert out[i, t].item() == logits[i, t].float().item(), (i, t)


def test_penalties_do_not_depend_on_the_history_order():
    reqs = [
        SamplingRequest(prompt=[3, 1, 3, 9], generated=[1, 1, 4, 3], repetition_penalty=1.4, frequency_penalty=0.3),
        SamplingRequest(prompt=[5], generated=[5, 5], presence_penalty=0.7),
    ]
    shuffled = [
        SamplingRequest(prompt=[9, 3, 1, 3], generated=[3, 4, 1, 1], repetition_penalty=1.4, frequency_penalty=0.3),
        SamplingRequest(prompt=[5], generated=[5, 5], presence_penalty=0.7),
    ]
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(1)) * 3
    sb = SamplingBatch.from_plan(make_plan(reqs), "cpu")
    other = SamplingBatch.from_plan(make_plan(shuffled), "cpu")
    assert torch.equal(apply_bias_and_penalties(logits, sb), apply_bias_and_penalties(logits, other))


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_with_lowest_id_on_ties(device):
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0], [7.0, 7.0, 7.0, 7.0], [-1.0, -2.0, -0.5, -0.5]])
    # A wide row too, so a parallel argmax has to merge partial results across the ties.
    wide = torch.zeros(1, 200000)
    wide[0, [150000, 70000, 199999]] = 3.0
    reqs = [SamplingRequest(temperature=0.0, top_p=0.5, top_k=3, min_p=0.5) for _ in range(3)]
    sb = SamplingBatch.from_plan(make_plan(reqs), device)
    wide_sb = SamplingBatch.from_plan(make_plan([SamplingRequest(temperature=0.0)]), device)
    for _ in range(5):
        assert sample(logits.to(device), sb).tokens.tolist() == [1, 0, 2]
        assert sample(wide.to(device), wide_sb).tokens.tolist() == [70000]


def test_greedy_applies_penalties_first():
    # Token 1 leads, but it was generated twice and the frequency penalty pushes it below token 3.
    sb = batch(SamplingRequest(prompt=[0], generated=[1, 1], temperature=0.0, frequency_penalty=1.0))
    assert sample(torch.tensor([[0.0, 3.0, 0.0, 2.0]]), sb).tokens.tolist() == [3]


def test_tiny_temperature_is_greedy():
    logits = torch.tensor([[0.0, 1.0, 0.999, -3.0]])
    for _ in range(20):
        assert sample(logits, batch(SamplingRequest(temperature=1e-6))).tokens.tolist() == [1]


def test_top_p_one_keeps_everything_even_a_negligible_tail():
    logits = [0.0, -40.0, 30.0, -80.0, 29.0]
    assert kept(logits, top_p=1.0) == [0, 1, 2, 3, 4]


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    # softmax([ln 5, ln 3, ln 2]) = [0.5, 0.3, 0.2]
    lg = [float(torch.tensor(5.0).log()), float(torch.tensor(3.0).log()), float(torch.tensor(2.0).log())]
    assert kept(lg, top_p=0.49) == [0]
    assert kept(lg, top_p=0.51) == [0, 1]
    assert kept(lg, top_p=0.79) == [0, 1]
    assert kept(lg, top_p=0.81) == [0, 1, 2]
    assert kept(lg, top_p=0.0) == [0]  # the top token always survives


def test_top_p_applies_to_the_top_k_distribution():
    # top_k=2 leaves [0.5, 0.3] -> renormalised [0.625, 0.375]: top_p=0.6 keeps only token 0,
    # top_p=0.7 needs both. (On the original distribution 0.6 would need two tokens as well.)
    lg = [float(torch.tensor(v).log()) for v in (5.0, 3.0, 2.0)]
    assert kept(lg, top_k=2, top_p=0.6) == [0]
    assert kept(lg, top_k=2, top_p=0.7) == [0, 1]


def test_top_p_counts_ties_of_the_kth_value_beyond_k():
    # top_k=2 keeps 5 and all three 3s (ties); p(token 0) = e^5 / (e^5 + 3 e^3) = 0.711, so
    # top_p=0.85 needs more than token 0, and the cut lands on the tied 3s: all four stay.
    lg = [5.0, 3.0, 3.0, 3.0, 0.0]
    assert kept(lg, top_k=2, top_p=0.85) == [0, 1, 2, 3]
    assert kept(lg, top_k=2, top_p=0.7) == [0]


def test_top_k_edges():
    lg = [0.3, 2.0, -1.0, 1.5, 0.9]
    assert kept(lg, top_k=1) == [1]
    assert kept(lg, top_k=2) == [1, 3]
    assert kept(lg, top_k=0) == [0, 1, 2, 3, 4]
    assert kept(lg, top_k=-1) == [0, 1, 2, 3, 4]
    assert kept(lg, top_k=5) == [0, 1, 2, 3, 4]
    assert kept(lg, top_k=100) == [0, 1, 2, 3, 4]


def test_top_k_keeps_ties_at_the_boundary():
    assert kept([1.0, 2.0, 1.0, 0.0], top_k=2) == [0, 1, 2]


def test_top_k_one_always_samples_the_top_token():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=gen)
    sb = batch(*[SamplingRequest(top_k=1, temperature=1.5) for _ in range(64)])
    assert torch.equal(sample(logits, sb, gen).tokens, logits.argmax(dim=1))


def test_min_p_edges():
    # probs proportional to [4, 2, 1, 1]: p / p_max = [1, 0.5, 0.25, 0.25]
    lg = [float(torch.tensor(v).log()) for v in (4.0, 2.0, 1.0, 1.0)]
    assert kept(lg, min_p=0.0) == [0, 1, 2, 3]
    assert kept(lg, min_p=0.25) == [0, 1, 2, 3]
    assert kept(lg, min_p=0.3) == [0, 1]
    assert kept(lg, min_p=0.6) == [0]
    assert kept(lg, min_p=1.0) == [0]
    assert kept([2.0, 1.0, 2.0], min_p=1.0) == [0, 2]  # every token as likely as the top one


def test_min_p_uses_the_tempered_distribution():
    # At temperature 2, p / p_max = [1, 0.5 ** 0.5, 0.25 ** 0.5] = [1, 0.707, 0.5].
    lg = [float(torch.tensor(v).log()) for v in (4.0, 2.0, 1.0)]
    assert kept(lg, min_p=0.6) == [0]
    assert kept(lg, min_p=0.6, temperature=2.0) == [0, 1]


def test_empty_batch():
    sb = batch(SamplingRequest(sample=False))
    out = sample(torch.zeros(0, 10), sb)
    assert out.tokens.shape == (0,) and out.logprobs.shape == (0,) and out.top_ids.shape == (0, 0)


def test_rows_are_the_sampling_requests_in_plan_order():
    plan = make_plan(
        [
            SamplingRequest(sample=False, prompt=[1, 2], query_len=2),
            SamplingRequest(temperature=0.0),
            SamplingRequest(sample=False),
            SamplingRequest(temperature=0.0),
        ]
    )
    sb = SamplingBatch.from_plan(plan, "cpu")
    assert sb.req_index.tolist() == [1, 3]
    out = sample(torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]), sb)
    assert out.tokens.tolist() == [1, 2]


def test_history_ids_outside_the_vocabulary_are_ignored():
    plan = make_plan(
        [SamplingRequest(prompt=[0, 9, 2], generated=[9, 3, 1], repetition_penalty=2.0, presence_penalty=1.0)]
    )
    plan.history[2] = -3  # the prompt's 2 becomes an impossible id
    out = apply_bias_and_penalties(torch.full((1, 5), 4.0), SamplingBatch.from_plan(plan, "cpu"))
    assert out.tolist() == [[2.0, 1.0, 4.0, 1.0, 4.0]]
