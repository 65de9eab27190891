"""Each row's log-sum-exp and k largest values in one read ("row_lse_topk"): the Triton backend
against the torch reference (torch.logsumexp of the float32 rows, torch.topk) on fresh random rows
of float32 and bf16: the lse to float32 rounding, the top values exactly and in order, and every
reported index holding its value (ties may report other indices than torch's). Also rows with
-inf entries, rows of -inf, +inf, ties, fewer finite values than k, and k at its limits.

On the GPU at GLM-5's vocabulary; without one in Triton's CPU interpreter at small sizes.
"""

import os

import pytest
import torch

pytest.importorskip("triton")

from nsaserve.kernels.registry import available, get_backend, resolve  # noqa: E402
from nsaserve.kernels.row_logsumexp import row_lse_topk_torch  # noqa: E402
from nsaserve.kernels.triton_row_lse_topk import BLOCK, CANDIDATES, row_lse_topk_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
SHAPES = [(1, 154880), (300, 154880), (5, 40001)] if DEV == "cuda" else [(3, 2 * BLOCK + 17), (2, 100)]


def check(x: torch.Tensor, k: int, msg: str = "") -> None:
    lse, vals, ids = row_lse_topk_triton(x, k)
    want_lse, want_vals, _ = row_lse_topk_torch(x, k)
    assert lse.dtype == vals.dtype == torch.float32 and ids.dtype == torch.int64
    assert vals.shape == ids.shape == (x.shape[0], k)
    torch.testing.assert_close(lse, want_lse, rtol=2e-6, atol=2e-6, msg=msg)
    assert torch.equal(vals, want_vals), msg  # exact values, largest first
    assert ((ids >= 0) & (ids < x.shape[1])).all(), msg
    assert torch.equal(x.gather(1, ids).float(), vals), msg  # each index holds its value
    for r in range(x.shape[0]):
        assert len(set(ids[r].tolist())) == k, msg  # k distinct positions


def test_registered_and_triton_on_cuda():
    assert {"torch", "triton"} <= set(available("row_lse_topk"))
    assert resolve("row_lse_topk", "auto", "cuda") == ("triton" if "triton" in available("row_lse_topk") else "torch")
    assert resolve("row_lse_topk", "auto", "cpu") == "torch"
    assert get_backend("row_lse_topk", "torch") is row_lse_topk_torch


@pytest.mark.parametrize("rows,vocab", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_triton_matches_torch(rows, vocab, dtype, k):
    g = torch.Generator(device=DEV).manual_seed(SEED + rows + vocab + k)
    scale = torch.rand(rows, 1, generator=g, device=DEV) * 20
    x = (torch.randn(rows, vocab, generator=g, device=DEV) * scale).to(dtype)
    x[0, ::3] = float("-inf")
    check(x, k, f"seed {SEED}")


def test_ascending_rows_replace_the_list_in_every_block():
    """Each block beats the whole list: every round of every block replaces a candidate."""
    x = torch.arange(3 * BLOCK + 5, dtype=torch.float32, device=DEV).repeat(2, 1)
    x[1] = x[1].flip(0)  # and descending: only the first block fills it
    check(x, 7)


def test_ties_infinities_and_short_rows():
    V = BLOCK + 300
    x = torch.randn(6, V, device=DEV)
    x[0] = float("-inf")  # nothing finite: lse -inf, the values -inf at k distinct positions
    x[1, 17] = float("inf")  # lse +inf, +inf first
    x[2] = 1.5  # all tied
    x[3] = float("-inf")
    x[3, [3, BLOCK + 7]] = torch.tensor([2.0, 1.0], device=DEV)  # fewer finite values than k
    x[4, :] = -1e30
    x[5, ::2] = 4.0  # ties across blocks at the top
    check(x, 5)
    check(x, CANDIDATES)


def test_limits():
    x = torch.randn(2, 40, device=DEV)
    check(x, 40 if CANDIDATES >= 40 else CANDIDATES)
    with pytest.raises(ValueError):
        row_lse_topk_triton(x, 0)
    with pytest.raises(ValueError):
        row_lse_topk_triton(torch.randn(2, 100, device=DEV), CANDIDATES + 1)
