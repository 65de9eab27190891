"""The sampler's filters as one threshold per row ("sample_threshold"): the Triton backend finds the
reference's values (which sorts every row) on fresh random rows, and the sampler's fused path
(threshold + pick) samples the same tokens as its step-by-step path (process_logits).

Top-k and min-p must match bit for bit. Top-p's masses are float32 sums in another order than the
reference's, so a row may differ only where its cut lies within rounding of top_p (checked in
float64). On the GPU at GLM-5's vocabulary; without one in Triton's CPU interpreter at small sizes.
"""

import os

import pytest
import torch

pytest.importorskip("triton")

from nsaserve.kernels import triton_sample_threshold as tst  # noqa: E402
from nsaserve.kernels.registry import available, get_backend, resolve  # noqa: E402
from nsaserve.kernels.sample_threshold import sample_threshold_torch  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
# (rows, vocab): one piece a row, several pieces (the last one shorter).
SHAPES = [(1, 154880), (64, 154880), (300, 154880), (7, 40000)] if DEV == "cuda" else [(6, 3000), (3, 2 * tst.MIN_PIECE + 100)]


def filters(rows, vocab, g):
    """Every combination of top-k / top-p / min-p on and off, at values that matter."""
    r = torch.rand(rows, 4, generator=g, device=DEV)
    temp = 0.3 + 1.5 * r[:, 0]
    top_k = torch.randint(1, 300, (rows,), generator=g, device=DEV)
    top_k = torch.where(r[:, 1] < 0.4, 0, top_k)  # off
    top_k[r[:, 1] > 0.95] = vocab  # k = V: off too
    top_p = torch.where(r[:, 2] < 0.3, 1.0, 0.05 + 0.94 * r[:, 2])
    min_p = torch.where(r[:, 3] < 0.6, 0.0, 0.2 * r[:, 3])
    return temp, top_k, top_p, min_p


def logits(rows, vocab, g, kind):
    x = torch.randn(rows, vocab, generator=g, device=DEV)
    if kind == "gaussian":
        return x * 4
    if kind == "flat":  # unit-scale logits (a randomly initialised model's): top-p keeps most of the row
        return x
    if kind == "peaked":  # a few likely tokens over a flat tail, as a trained model's
        x[:, :: max(1, vocab // 40)] += 12.0
        return x
    if kind == "ties":  # whole numbers: the k-th value and the cut tie with many others
        return (x * 2).round()
    raise ValueError(kind)


def borderline(y, th_a, th_b, top_k, top_p):
    """Whether two thresholds of a row are both a top-p cut within rounding of top_p (float64)."""
    if top_p >= 1.0:
        return False
    vals = y.double().sort(descending=True).values
    V = vals.numel()
    k = int(top_k) if 0 < int(top_k) < V else V
    e = (vals - vals[0]).exp().masked_fill(vals < vals[k - 1], 0.0)
    cum = e.cumsum(0) / e.sum()

    def mass_above(t):  # mass strictly above t, and at or above it
        return float(cum[(vals > t).sum() - 1]) if (vals > t).any() else 0.0, float(cum[(vals >= t).sum() - 1])

    lo, hi = sorted((float(th_a), float(th_b)))
    # Between the two cuts lies one step of the cumulative mass, which top_p sits on within rounding.
    return abs(mass_above(hi)[1] - float(top_p)) < 1e-5 or abs(mass_above(lo)[0] - float(top_p)) < 1e-5


def check(x, temp, top_k, top_p, min_p):
    got = tst.sample_threshold_triton(x, temp, top_k, top_p, min_p)
    want = sample_threshold_torch(x, temp, top_k, top_p, min_p)
    assert got.dtype == torch.float32 and got.shape == want.shape
    y = x.float() / temp.unsqueeze(1)
    for row in torch.nonzero(got != want).flatten().tolist():
        assert borderline(y[row], got[row], want[row], top_k[row], top_p[row]), (
            f"seed {SEED} row {row}: {got[row].item()} != {want[row].item()} "
            f"(k {top_k[row].item()}, p {top_p[row].item()}, min_p {min_p[row].item()})"
        )
    return got


def test_registered_and_auto_on_cuda():
    assert {"torch", "triton"} <= set(available("sample_threshold"))
    assert resolve("sample_threshold", "auto", "cuda") == "triton"
    assert resolve("sample_threshold", "auto", "cpu") == "torch"
    assert get_backend("sample_threshold", "torch") is sample_threshold_torch


@pytest.mark.parametrize("rows,vocab", SHAPES)
@pytest.mark.parametrize("kind", ["gaussian", "flat", "peaked", "ties"])
def test_triton_finds_the_reference_thresholds(rows, vocab, kind):
    g = torch.Generator(device=DEV).manual_seed(SEED + rows + vocab)
    check(logits(rows, vocab, g, kind), *filters(rows, vocab, g))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_model_dtype_rows_and_edge_values(dtype):
    """bf16 rows (the decode graphs' lm_head output), -inf tokens, a row of one value, k = 1 and
    V - 1, top_p near 0, min_p = 1."""
    rows, vocab = (8, 154880) if DEV == "cuda" else (8, 2000)
    g = torch.Generator(device=DEV).manual_seed(SEED + 1)
    x = logits(rows, vocab, g, "gaussian").to(dtype)
    x[0, 1::2] = float("-inf")
    x[1] = 3.0
    t = lambda *v: torch.tensor(v, device=DEV)  # noqa: E731
    temp = t(0.7, 1.0, 1.0, 0.5, 1.3, 1.0, 0.9, 1.0)
    top_k = t(50, 7, 1, vocab - 1, 0, 0, 5, 0)
    top_p = t(0.9, 0.5, 1.0, 0.99, 1e-9, 0.0, 1.0, 0.999)
    min_p = t(0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 1.0, 0.05)
    th = check(x, temp, top_k, top_p, min_p)
    y = x.float() / temp.unsqueeze(1)
    assert th[1] == 3.0  # every token ties: all survive
    assert th[2] == y[2].max() and th[4] == y[4].max() and th[5] == y[5].max()


@pytest.mark.parametrize("rows,vocab", SHAPES[:1] if DEV == "cuda" else SHAPES)
def test_rows_that_overflow_the_scratch_search_the_row(rows, vocab, monkeypatch):
    """More values near the cut than the scratch holds: the search reads the row instead."""
    monkeypatch.setattr(tst, "CAP", 16)
    g = torch.Generator(device=DEV).manual_seed(SEED + 2)
    temp, top_k, top_p, min_p = filters(rows, vocab, g)
    check(logits(rows, vocab, g, "ties"), temp, top_k.clamp(min=40), top_p, min_p)


@pytest.mark.parametrize("cap", [None, 16])
def test_wide_rows_and_top_k_beyond_the_finite_values(cap, monkeypatch):
    """Low temperatures (the k-th value far below the maximum: past the ladder's fixed steps),
    and rows with fewer finite values than top-k, some of them with top-p too."""
    if cap:
        monkeypatch.setattr(tst, "CAP", cap)
    rows, vocab = (6, 154880) if DEV == "cuda" else (6, 3000)
    g = torch.Generator(device=DEV).manual_seed(SEED + 4)
    x = logits(rows, vocab, g, "gaussian")
    x[3:, 40:] = float("-inf")  # 40 finite values
    t = lambda *v: torch.tensor(v, device=DEV)  # noqa: E731
    th = check(x, t(0.05, 0.1, 0.05, 1.0, 1.0, 0.7), t(200, 50, 0, 60, 60, 30), t(1.0, 0.9, 0.99, 1.0, 0.8, 0.9),
               t(0.0, 0.0, 0.0, 0.0, 0.0, 0.01))  # fmt: skip
    assert th[3] == float("-inf")  # k = 60 > 40 finite values: every finite one survives


def test_the_fused_sampler_samples_the_step_by_step_tokens():
    """sample(..., backend="triton") (threshold + pick) against the torch path (penalties,
    temperature, top-k, top-p, min-p one after another), greedy rows and penalties included."""
    from nsaserve.worker.sampler import sample
    from nsaserve.worker.sampling_batch import SamplingBatch
    from nsaserve.worker.sampling_plans import SamplingRequest, make_plan

    vocab = 154880 if DEV == "cuda" else 3000
    g = torch.Generator(device=DEV).manual_seed(SEED + 3)
    reqs = []
    for i in range(24):
        r = SamplingRequest(temperature=0.0 if i % 7 == 0 else 0.5 + (i % 5) * 0.3)
        r.top_k = (0, 20, 100)[i % 3]
        r.top_p = (1.0, 0.9, 0.6, 0.95)[i % 4]
        r.min_p = 0.05 if i % 5 == 1 else 0.0
        if i % 6 == 2:
            r.prompt, r.generated, r.repetition_penalty, r.frequency_penalty = [1, 2, 3], [4, 4, 5], 1.2, 0.3
        reqs.append(r)
    sb = SamplingBatch.from_plan(make_plan(reqs), DEV)
    x = logits(len(reqs), vocab, g, "peaked")
    for dtype in (torch.float32, torch.bfloat16):
        state = torch.random.get_rng_state() if DEV == "cpu" else torch.cuda.get_rng_state()
        gen = torch.Generator(device=DEV).manual_seed(SEED)
        fused = sample(x.to(dtype), sb, generator=gen, backend="triton").tokens
        gen = torch.Generator(device=DEV).manual_seed(SEED)
        stepwise = sample(x.to(dtype), sb, generator=gen, backend="torch").tokens
        assert torch.equal(fused, stepwise), f"seed {SEED} {dtype}"
        assert torch.equal(state, torch.random.get_rng_state() if DEV == "cpu" else torch.cuda.get_rng_state())
