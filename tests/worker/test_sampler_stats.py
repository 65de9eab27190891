"""Sampled frequencies follow the filtered softmax (chi-square goodness of fit, fixed seeds)."""

import numpy as np
import pytest
import torch

from nsaserve.worker.sampler import SamplingBatch, sample
from nsaserve.worker.sampling_plans import SamplingRequest, make_plan

LOGITS = torch.tensor([2.0, 1.5, 0.3, 0.0, -0.5, -1.0, -2.0, -4.0])
N = 20000
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi-square >= observed) under `probs`; categories with zero probability must be empty."""
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token the filters dropped"
    expected = probs[support].double() * counts.sum()
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def frequencies(reqs: list[SamplingRequest], gen_seed: int, device: str = "cpu") -> torch.Tensor:
    sb = SamplingBatch.from_plan(make_plan(reqs), device)
    logits = LOGITS.to(device).expand(len(reqs), -1).contiguous()
    tokens = sample(logits, sb, torch.Generator(device).manual_seed(gen_seed)).tokens
    return torch.bincount(tokens.cpu(), minlength=len(LOGITS))


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_sampling_matches_softmax(device):
    counts = frequencies([SamplingRequest(temperature=0.7) for _ in range(N)], gen_seed=0, device=device)
    assert chi_square_p_value(counts, torch.softmax(LOGITS / 0.7, 0)) > 1e-3


def test_filtered_sampling_matches_renormalised_softmax():
    # top_k=6 drops the two least likely; top_p=0.9 of the rest then drops the tail after
    # it reaches 90%; what remains is drawn in proportion to its softmax.
    reqs = [SamplingRequest(temperature=1.2, top_k=6, top_p=0.9) for _ in range(N)]
    counts = frequencies(reqs, gen_seed=1)
    p = torch.softmax(LOGITS / 1.2, 0)
    p[6:] = 0
    p /= p.sum()
    cut = int((p.cumsum(0) < 0.9).sum()) + 1
    p[cut:] = 0
    p /= p.sum()
    assert 3 <= cut < 6  # the example really exercises top-p on top of top-k
    assert chi_square_p_value(counts, p) > 1e-3


def test_seeded_rows_match_softmax_across_positions():
    # One seed, a different token position per request: the per-position streams must be as
    # good as fresh noise. Positions are set directly (the sampler reads only the last one).
    plan = make_plan([SamplingRequest(prompt=[0], seed=99) for _ in range(N)])
    plan.positions = np.arange(N, dtype=np.int32)
    sb = SamplingBatch.from_plan(plan, "cpu")
    assert len(sb.seeded) == N
    tokens = sample(LOGITS.expand(N, -1).contiguous(), sb).tokens
    counts = torch.bincount(tokens, minlength=len(LOGITS))
    assert chi_square_p_value(counts, torch.softmax(LOGITS, 0)) > 1e-3


def test_chi_square_detects_a_wrong_distribution():
    # The check itself has power: the same draws against the untempered softmax fail.
    counts = frequencies([SamplingRequest(temperature=0.7) for _ in range(N)], gen_seed=0)
    assert chi_square_p_value(counts, torch.softmax(LOGITS, 0)) < 1e-6
