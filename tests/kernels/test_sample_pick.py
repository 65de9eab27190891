"""The sampler's pick, argmax(x + Gumbel(u)) per row ("sample_pick"): the fused Triton backend
picks exactly the torch reference's tokens on fresh random inputs, with greedy rows, filtered
(-inf) logits, ties (the lowest id wins) and rows cut into several pieces.

On the GPU at GLM-5's vocabulary; without one in Triton's CPU interpreter at small sizes.
"""

import os

import pytest
import torch

pytest.importorskip("triton")

from nsaserve.kernels.registry import available, get_backend, resolve  # noqa: E402
from nsaserve.kernels.sample_pick import sample_pick_torch  # noqa: E402
from nsaserve.kernels.triton_sample_pick import MIN_PIECE, pieces_for, sample_pick_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
# (rows, vocab): one piece, several pieces, a last piece shorter than the others.
SHAPES = (
    [(1, 154880), (64, 154880), (256, 154880), (7, 40000)] if DEV == "cuda" else [(3, 1000), (2, 3 * MIN_PIECE + 5)]
)


def inputs(rows, vocab, seed):
    g = torch.Generator(device=DEV).manual_seed(SEED + seed)
    x = torch.randn(rows, vocab, generator=g, device=DEV) * 4
    u = torch.rand(rows, vocab, generator=g, device=DEV)
    return x, u, g


def test_registered_and_auto_on_cuda():
    assert {"torch", "triton"} <= set(available("sample_pick"))
    assert resolve("sample_pick", "auto", "cuda") == "triton"
    assert resolve("sample_pick", "auto", "cpu") == "torch"
    assert get_backend("sample_pick", "torch") is sample_pick_torch


@pytest.mark.parametrize("rows,vocab", SHAPES)
@pytest.mark.parametrize("greedy", [False, True])
def test_triton_picks_the_reference_tokens(rows, vocab, greedy):
    x, u, g = inputs(rows, vocab, rows + vocab)
    # Filtered tokens (-inf), a uniform of 0 (that token never wins) and one near 1.
    x[:, 1::3] = float("-inf")
    u[:, 5] = 0.0
    u[:, 6] = 1.0 - 2.0**-24
    mask = torch.rand(rows, generator=g, device=DEV) < 0.5 if greedy else None
    want = sample_pick_torch(x, u, mask)
    got = sample_pick_triton(x, u, mask)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, want), f"seed {SEED}"
    if greedy:
        assert torch.equal(got[mask], x[mask].argmax(dim=1)), f"seed {SEED}"


@pytest.mark.parametrize("rows,vocab", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_temperature_folded_into_the_pick(rows, vocab, dtype):
    """With temperature the pick divides the raw logits itself (bf16 or float32), correctly
    rounded: the same tokens as dividing first in torch, as the sampler's process_logits does."""
    x, u, g = inputs(rows, vocab, 7 * rows + vocab)
    x = x.to(dtype)
    greedy = torch.rand(rows, generator=g, device=DEV) < 0.3
    t = torch.rand(rows, generator=g, device=DEV) * 1.9 + 0.05
    t[greedy] = 1.0  # the sampling batch's temperature on greedy rows
    want = sample_pick_torch(x.float() / t.unsqueeze(1), u, greedy)
    assert torch.equal(sample_pick_torch(x, u, greedy, t), want)
    assert torch.equal(sample_pick_triton(x, u, greedy, t), want), f"seed {SEED}"


@pytest.mark.parametrize("rows,vocab", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threshold_cut_inside_the_pick(rows, vocab, dtype):
    """With a threshold per row, tokens whose divided logit is below it are out, as the filters'
    -inf: the same tokens as filtering first in torch."""
    x, u, g = inputs(rows, vocab, 11 * rows + vocab)
    x = x.to(dtype)
    greedy = torch.rand(rows, generator=g, device=DEV) < 0.3
    t = torch.where(greedy, 1.0, torch.rand(rows, generator=g, device=DEV) + 0.5)
    y = x.float() / t.unsqueeze(1)
    # Thresholds at the 1st, 20th and 500th largest value, and -inf (nothing cut).
    ranks = torch.tensor([1, 20, 500, vocab], device=DEV)[torch.arange(rows, device=DEV) % 4]
    th = y.sort(dim=1, descending=True).values.gather(1, (ranks - 1).unsqueeze(1)).squeeze(1)
    th[ranks == vocab] = float("-inf")
    want = sample_pick_torch(y.masked_fill(y < th.unsqueeze(1), float("-inf")), u, greedy)
    assert torch.equal(sample_pick_torch(x, u, greedy, t, th), want)
    got = sample_pick_triton(x, u, greedy, t, th)
    assert torch.equal(got, want), f"seed {SEED}"
    assert (y.gather(1, got.unsqueeze(1)).squeeze(1) >= th).all()


@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_ties_go_to_the_lowest_id_across_pieces(rows, vocab):
    assert pieces_for(rows, vocab) >= 1
    x = torch.full((rows, vocab), float("-inf"), device=DEV)
    u = torch.full((rows, vocab), 0.5, device=DEV)  # the same noise everywhere: ties stay ties
    late = [vocab - 1, vocab // 2, MIN_PIECE + 3 if vocab > MIN_PIECE + 3 else vocab - 2]
    x[:, late] = 2.0
    x[0, :] = float("-inf")  # nothing left at all: argmax's answer is the first token
    got = sample_pick_triton(x, u, None)
    assert torch.equal(got, sample_pick_torch(x, u, None))
    assert got[0] == 0 and (rows == 1 or (got[1:] == min(late)).all())


def test_sampler_uses_the_backend_it_is_given():
    from nsaserve.worker.sampler import pick_tokens

    class Batch:  # the two fields pick_tokens reads
        any_greedy = True
        greedy = torch.tensor([True, False, True], device=DEV)

    x, u, _ = inputs(3, 4000, 1)
    want = sample_pick_torch(x, u, Batch.greedy)
    assert torch.equal(pick_tokens(x, u, Batch, backend="triton"), want)
    assert torch.equal(pick_tokens(x, u, Batch), want)  # "auto": triton on CUDA, torch elsewhere
