"""The sampler's uniforms ("sample_uniform"): the torch reference is Philox4x32-10 (checked against
the generator's published known-answer vectors and against Triton's own Philox), and the Triton
backend writes the reference's values bit for bit, at vocabularies that are and are not multiples
of 4, for fresh random seeds every run.

On the GPU at GLM-5's vocabulary; without one in Triton's CPU interpreter at small sizes.
"""

import os

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nsaserve.kernels.registry import available, get_backend, resolve  # noqa: E402
from nsaserve.kernels.sample_uniform import MASK32, philox4x32, philox_rounds, sample_uniform_torch  # noqa: E402
from nsaserve.kernels.triton_sample_uniform import sample_uniform_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
# (rows, vocab): GLM-5's vocabulary and odd sizes (a last program's partial block, V % 4 != 0).
SHAPES = [(1, 154880), (300, 154880), (5, 40001), (3, 7)] if DEV == "cuda" else [(3, 4097), (2, 4099), (4, 3), (1, 1)]

# Philox4x32-10 known answers (Random123's kat_vectors): counter, key -> output words.
KNOWN = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK32,) * 4, (MASK32,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def random_seeds(n, offset=0):
    g = torch.Generator().manual_seed(SEED + offset)
    s = torch.randint(-(2**63), 2**63 - 1, (n,), generator=g, dtype=torch.int64)
    s[: min(n, 3)] = torch.tensor([0, -1, 2**63 - 1][: min(n, 3)])  # all-zero and all-one keys too
    return s


def test_registered_and_auto_on_cuda():
    assert {"torch", "triton"} <= set(available("sample_uniform"))
    assert resolve("sample_uniform", "auto", "cuda") == "triton"
    assert resolve("sample_uniform", "auto", "cpu") == "torch"
    assert get_backend("sample_uniform", "torch") is sample_uniform_torch


@pytest.mark.parametrize("counter,key,want", KNOWN)
def test_reference_philox_known_answers(counter, key, want):
    words = philox_rounds([torch.tensor([c]) for c in counter], [torch.tensor([k]) for k in key])
    assert [int(w) for w in words] == list(want)


@triton.jit
def _triton_philox(seed_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    a, b, c, d = tl.randint4x(tl.load(seed_ptr), offs)
    tl.store(out_ptr + offs, a)
    tl.store(out_ptr + N + offs, b)
    tl.store(out_ptr + 2 * N + offs, c)
    tl.store(out_ptr + 3 * N + offs, d)


def test_reference_matches_tritons_own_philox():
    """An independent implementation: Triton's tl.randint4x keys Philox4x32-10 the same way (low
    and high 32 bits of the seed) on counter (j, 0, 0, 0)."""
    n = 256
    for s in random_seeds(4).tolist():
        seed = torch.tensor([s], dtype=torch.int64, device=DEV)
        out = torch.zeros(4 * n, dtype=torch.int32, device=DEV)
        _triton_philox[(1,)](seed, out, N=n)
        theirs = out.cpu().to(torch.int64) & MASK32
        mine = philox4x32(seed.cpu(), torch.arange(n))
        for i in range(4):
            assert torch.equal(mine[i][0], theirs[i * n : (i + 1) * n]), (SEED, s, i)


@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_triton_writes_the_reference_values(rows, vocab):
    seeds = random_seeds(rows, rows + vocab).to(DEV)
    got = sample_uniform_triton(seeds, vocab)
    want = sample_uniform_torch(seeds, vocab)
    assert got.dtype == torch.float32 and got.shape == (rows, vocab)
    assert torch.equal(got, want), f"seed {SEED}: {(got != want).sum().item()} values differ"


def test_values_are_24_bit_uniforms_in_the_unit_interval():
    """Fixed seeds (a statistical check must not flake): every value k * 2^-24 in [0, 1), the mean
    and the 16 bins' counts where uniform draws put them (bounds of about 6 standard deviations),
    and rows of different seeds unrelated."""
    vocab = 4096 * 4
    u = sample_uniform_torch(torch.arange(8, dtype=torch.int64) * 7919, vocab)
    assert bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(u * 2**24, (u * 2**24).round())
    n = u.numel()
    assert abs(u.mean().item() - 0.5) < 6 * (1 / 12 / n) ** 0.5
    counts = torch.histc(u, bins=16, min=0.0, max=1.0)
    expect = n / 16
    assert bool(((counts - expect).abs() < 6 * (expect * 15 / 16) ** 0.5).all()), counts.tolist()
    corr = torch.corrcoef(u)
    assert (corr - torch.eye(8)).abs().max().item() < 6 / vocab**0.5


def test_a_row_depends_only_on_its_seed_and_the_vocabulary():
    seeds = random_seeds(5, 99).to(DEV)
    batch = sample_uniform_triton(seeds, 1000)
    alone = sample_uniform_triton(seeds[3:4], 1000)
    assert torch.equal(batch[3], alone[0])
    assert not torch.equal(batch[0], batch[1])
