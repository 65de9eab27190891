"""The penalties ("penalties" kind): the Triton backend equals the torch reference bit for bit on
fresh random histories: repeated tokens (within the prompt, the generated part and across both),
ids outside the vocabulary, rows with and without a pending token, empty histories, rows whose
history is longer than one block of the kernel, logits of both signs and -inf.

On the GPU at GLM-5's vocabulary; without one in Triton's CPU interpreter at small sizes.
"""

import os
import random

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from nsaserve.kernels.penalties import penalties_torch  # noqa: E402
from nsaserve.kernels.registry import available, resolve  # noqa: E402
from nsaserve.kernels.triton_penalties import BLOCK, penalties_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
CASES = [(1, 154880, 1400), (64, 154880, 3000), (7, 1000, 2 * BLOCK + 5)] if DEV == "cuda" else [(5, 300, BLOCK + 7), (2, 40, 30)]


def make_case(S, V, max_len, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(S, V, generator=g) * 5
    # -inf logits, but not at id 0: a history drawn from a vocabulary part of one id is all id 0, and
    # the case must still penalise a finite logit (seed 1555756961 penalised only -inf ones).
    logits[0, 1::7] = float("-inf")
    P = rng.randint(1, S)
    rows = sorted(rng.sample(range(S), P))
    hist, start, length, prompt, pending = [], [], [], [], []
    for i, _ in enumerate(rows):
        n = max_len if i == 0 else rng.choice([0, 1, rng.randint(1, max_len), max_len])  # one long history
        vocab_part = rng.randint(1, V)  # a small id range gives many repeats
        toks = [rng.randrange(vocab_part) for _ in range(n)]
        for i in rng.sample(range(n), min(n, 3)):
            toks[i] = rng.choice([-1, V, V + 17])  # outside the vocabulary: ignored
        start.append(len(hist))
        hist += toks
        length.append(n)
        prompt.append(rng.randint(0, n))
        pending.append(rng.choice([-1, rng.randrange(V), rng.randrange(vocab_part)]))
    length_np = np.array(length, dtype=np.int64)
    first = np.cumsum(length_np + 1) - (length_np + 1)
    rep = torch.rand(S, generator=g) + 0.5
    freq = torch.rand(S, generator=g) - 0.2
    pres = torch.rand(S, generator=g) - 0.2

    def t(a, dtype=torch.int64):
        return torch.tensor(a, dtype=dtype, device=DEV)

    args = (V, t(hist, torch.int32) if hist else t([]), t(rows), t(start), t(length), t(prompt), t(pending), t(first.tolist()),
            rep.to(DEV), freq.to(DEV), pres.to(DEV), int(length_np.sum()), int(length_np.max()))  # fmt: skip
    return logits, args


def run(fn, logits, args):
    S, V = logits.shape
    flat = torch.empty(S * V + 1, dtype=torch.float32, device=DEV)
    flat[: S * V].copy_(logits.reshape(-1))
    fn(flat, *args)
    return flat[: S * V].view(S, V).cpu()


def test_registered_and_triton_on_cuda():
    assert {"torch", "triton"} <= set(available("penalties"))
    assert resolve("penalties", "auto", "cuda") == ("triton" if "triton" in available("penalties") else "torch")
    assert resolve("penalties", "auto", "cpu") == "torch"


@pytest.mark.parametrize("S,V,max_len", CASES)
@pytest.mark.parametrize("trial", range(3))
def test_triton_matches_torch_bit_for_bit(S, V, max_len, trial):
    seed = SEED + 1000 * trial + S
    logits, args = make_case(S, V, max_len, seed)
    want = run(penalties_torch, logits, args)
    got = run(penalties_triton, logits, args)
    assert torch.equal(got.isnan(), want.isnan()), f"seed {seed}"
    assert torch.equal(got, want), f"seed {seed}: {(got != want).sum().item()} logits differ"
    assert not torch.equal(want, logits), f"seed {seed}"  # the case penalised something


def test_no_penalised_rows_is_a_no_op():
    logits = torch.randn(3, 50)
    empty = torch.zeros(0, dtype=torch.int64, device=DEV)
    args = (50, empty, empty, empty, empty, empty, empty, empty, *(torch.ones(3, device=DEV),) * 3, 0, 0)
    assert torch.equal(run(penalties_triton, logits, args), logits)
