"""The step's row order for sparse MLA (kernels/mla_rows.py): every row once, longest first, each
with its count of valid entries; and the attention kernels running rows in that order, their loops
ending at those counts, give the reference's results (whole contexts and top-k lists, with and
without splits, rows of no entry to the full width)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before the kernels are built

from nsaserve.kernels.mla_rows import plan_row_order, row_lengths  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_rows_longest_first_ties_in_row_order():
    row_pos = torch.tensor([5, 0, 9000, 2047, 5, 2048, 300])
    plan = plan_row_order(row_pos, 2048)
    assert plan.rows.dtype == torch.int32 and plan.rows.shape == (7, 2)
    assert plan.rows[:, 0].tolist() == [2, 3, 5, 6, 0, 4, 1]
    assert plan.rows[:, 1].tolist() == [2048, 2048, 2048, 301, 6, 6, 1]
    assert row_lengths(row_pos, 2048).tolist() == [6, 1, 2048, 2048, 6, 2048, 301]


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_every_row_once(rows):
    g = torch.Generator().manual_seed(rows)
    row_pos = torch.randint(0, 3000, (rows,), generator=g)
    plan = plan_row_order(row_pos, 2048).rows.long()
    assert sorted(plan[:, 0].tolist()) == list(range(rows))
    assert torch.equal(plan[:, 1], (row_pos[plan[:, 0]] + 1).clamp(max=2048))
    assert bool((plan[:-1, 1] >= plan[1:, 1]).all())


def lists(row_pos: torch.Tensor, width: int, num_slots: int, g) -> torch.Tensor:
    """Each row's list: min(pos + 1, width) distinct random slots, then -1 (the indexer's top-k or
    a whole context, mapped to slots)."""
    n = row_lengths(row_pos, width).long()
    slots = torch.stack([torch.randperm(num_slots, generator=g)[:width] for _ in range(row_pos.numel())])
    return torch.where(torch.arange(width)[None, :] < n[:, None], slots, -1)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("whole", [True, False])
def test_triton_kernel_runs_rows_in_order(fp8, num_splits, whole):
    """Rows of mixed lengths in a shuffled order (as requests arrive), run longest first with their
    counts: the torch reference's results, the outputs in row order."""
    pytest.importorskip("triton")
    from nsaserve.kernels import kv_cache_format as fmt
    from nsaserve.kernels.sparse_mla import sparse_mla_torch
    from nsaserve.kernels.triton_sparse_mla import sparse_mla_decode

    gpu = DEV == "cuda"
    tokens, heads, rank, rope, width = (40, 64, 512, 64, 2048) if gpu else (6, 16, 256, 32, 96)
    g = torch.Generator().manual_seed(7 + fp8 + 2 * whole + (num_splits or 0))
    num_slots = 3 * width + 5
    cache = fmt.alloc_latent(num_slots, rank, rope, fp8, torch.bfloat16, "cpu")
    fmt.write_latent(cache, torch.arange(num_slots), torch.randn(num_slots, rank, generator=g),
                     torch.randn(num_slots, rope, generator=g))  # fmt: skip
    # Whole contexts stay within the width; top-k lists come from contexts past it too.
    row_pos = torch.randint(0, width if whole else 2 * width, (tokens,), generator=g)
    row_pos[0], row_pos[1] = 0, width - 1  # one entry; the full width
    slots = lists(row_pos, width, num_slots, g)
    q_lat = torch.randn(tokens, heads, rank, generator=g).bfloat16()
    q_pe = torch.randn(tokens, heads, rope, generator=g).bfloat16()
    want = sparse_mla_torch(q_lat, q_pe, cache, slots, 0.0625)
    on = lambda x: x.to(DEV)  # noqa: E731
    rows = plan_row_order(on(row_pos), width)
    assert rows.rows[0, 1] == width
    got = sparse_mla_decode(on(q_lat), on(q_pe), on(cache), on(slots), 0.0625, num_splits=num_splits, rows=rows)
    assert float((got.cpu() - want).norm() / want.norm()) < 1e-2


def test_backend_takes_the_order(monkeypatch):
    """The registry backend plans a row order where NSASERVE_MLA_ROW_ORDER is on (for whole contexts
    and top-k lists alike), or is "graphs" (the default) and the step is a CUDA-graph one; a work
    plan first where that is on, and nothing where both are off."""
    pytest.importorskip("triton")
    from nsaserve.kernels import triton_sparse_mla as tsm
    from nsaserve.kernels.mla_rows import RowOrder
    from nsaserve.kernels.mla_work import MlaWork

    row_pos = torch.tensor([3, 10, 1])
    assert tsm.ROW_ORDER == "graphs"  # the default
    assert tsm.plan_attention_work(row_pos, 8, True) is None
    assert isinstance(tsm.plan_attention_work(row_pos, 8, True, graph=True), RowOrder)
    monkeypatch.setattr(tsm, "ROW_ORDER", "off")
    assert tsm.plan_attention_work(row_pos, 8, True, graph=True) is None
    monkeypatch.setattr(tsm, "ROW_ORDER", "on")
    for whole in (True, False):
        assert isinstance(tsm.plan_attention_work(row_pos, 8, whole), RowOrder)
    assert tsm.plan_attention_work(row_pos[:0], 8, True) is None
    monkeypatch.setattr(tsm, "MLA_WORK", "on")
    assert isinstance(tsm.plan_attention_work(row_pos, 8, True), MlaWork)
    assert isinstance(tsm.plan_attention_work(row_pos, 8, False), RowOrder)
