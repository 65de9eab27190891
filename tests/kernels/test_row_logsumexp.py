"""Each row's log-sum-exp ("row_logsumexp"): the Triton backend agrees with torch.logsumexp on the
float32 rows to float32 rounding, on fresh random rows of float32 and bf16, with -inf tokens, rows
of -inf and rows holding +inf (which torch answers with -inf and +inf).

On the GPU at GLM-5's vocabulary; without one in Triton's CPU interpreter at small sizes.
"""

import os

import pytest
import torch

pytest.importorskip("triton")

from nsaserve.kernels.registry import available, get_backend, resolve  # noqa: E402
from nsaserve.kernels.row_logsumexp import row_logsumexp_torch  # noqa: E402
from nsaserve.kernels.triton_row_logsumexp import BLOCK, row_logsumexp_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
SHAPES = [(1, 154880), (300, 154880), (5, 40001)] if DEV == "cuda" else [(3, 2 * BLOCK + 17), (2, 100)]


def test_registered_and_auto_on_cuda():
    assert {"torch", "triton"} <= set(available("row_logsumexp"))
    assert resolve("row_logsumexp", "auto", "cuda") == "triton"
    assert resolve("row_logsumexp", "auto", "cpu") == "torch"
    assert get_backend("row_logsumexp", "torch") is row_logsumexp_torch


@pytest.mark.parametrize("rows,vocab", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_torch(rows, vocab, dtype):
    g = torch.Generator(device=DEV).manual_seed(SEED + rows + vocab)
    scale = torch.rand(rows, 1, generator=g, device=DEV) * 20
    x = (torch.randn(rows, vocab, generator=g, device=DEV) * scale).to(dtype)
    x[0, ::3] = float("-inf")
    got, want = row_logsumexp_triton(x), row_logsumexp_torch(x)
    assert got.dtype == torch.float32 and got.shape == (rows,)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6, msg=f"seed {SEED}")


def test_infinite_rows():
    x = torch.randn(4, 1000, device=DEV)
    x[0] = float("-inf")
    x[1, 17] = float("inf")
    x[2, :] = -1e30
    x[3, 5] = float("-inf")
    got, want = row_logsumexp_triton(x), row_logsumexp_torch(x)
    assert got[0].item() == float("-inf") and got[1].item() == float("inf")
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
