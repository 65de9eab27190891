"""The step's work plan for sparse MLA decode (kernels/mla_work.py): every row's valid entries
covered once by its parts, the parts longest first, spare programs last, the bounds kept; and the
attention kernels running a plan give the reference's results."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before the kernels are built

from nsaserve.kernels.mla_work import MIN_PART_BLOCKS, max_parts_for, plan_mla_work  # noqa: E402


def check_plan(n: torch.Tensor, topk: int, programs: int, block: int = 64):
    work = plan_mla_work(n, topk, programs, block)
    parts = work.parts.long()
    rows = n.numel()
    assert parts.shape == (rows * work.max_parts, 4)
    assert work.max_parts == max_parts_for(rows, programs, topk, block)
    live = parts[:, 0] >= 0
    # Spare programs come last; live parts longest first.
    assert bool(live[: int(live.sum())].all())
    length = parts[live, 3] - parts[live, 2]
    assert bool((length[:-1] >= length[1:]).all())
    # Each row: parts 0..count-1, covering [0, n) exactly, whole blocks except the row's end.
    counts = torch.bincount(parts[live, 0], minlength=rows)
    assert torch.equal(counts, work.counts.long()) and bool((counts >= 1).all())
    assert int(counts.max()) <= work.max_parts
    for r in range(rows):
        mine = parts[live & (parts[:, 0] == r)]
        mine = mine[mine[:, 1].argsort()]
        assert mine[:, 1].tolist() == list(range(len(mine)))
        assert int(mine[0, 2]) == 0 and int(mine[-1, 3]) == min(int(n[r]), topk)
        assert torch.equal(mine[1:, 2], mine[:-1, 3])
        assert bool((mine[:-1, 3] % block == 0).all())
    if int(n.max()) > 0:
        assert int(length.max()) >= min(int(n.max()), MIN_PART_BLOCKS * block) or int(length.max()) == int(n.max())
    return work


@pytest.mark.parametrize("rows", [1, 3, 8, 64, 131, 132, 200])
def test_plans_cover_every_entry_once_longest_first(rows):
    g = torch.Generator().manual_seed(rows)
    n = torch.randint(819, 2049, (rows,), generator=g)
    check_plan(n, 2048, 132)


def test_short_and_empty_rows():
    n = torch.tensor([0, 1, 63, 64, 65, 2048, 5000])  # 5000: more than the top-k (clamped)
    work = check_plan(n, 2048, 4)
    assert work.max_parts == 1  # 7 rows on 4 programs: no row split


def test_one_wave_for_fewer_rows_than_programs():
    """64 rows of serving's mix on 132 programs: parts near an even share, where the plain split
    (two parts of 1024 a row) runs parts of up to 1024."""
    g = torch.Generator().manual_seed(5)
    n = torch.randint(819, 2049, (64,), generator=g)
    work = check_plan(n, 2048, 132)
    live = work.parts[:, 0] >= 0
    longest = int((work.parts[live, 3] - work.parts[live, 2]).max())
    assert longest < 1024 and longest <= 2 * int(n.sum()) // 132


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tokens", [3, 9])
def test_triton_kernel_runs_a_plan(fp8, tokens):
    """Whole-context rows of mixed lengths through the Triton decode kernel with a plan (parts of
    rows, a merge by counts where rows have several): the torch reference's results."""
    pytest.importorskip("triton")
    from nsaserve.kernels import kv_cache_format as fmt
    from nsaserve.kernels.sparse_mla import sparse_mla_torch
    from nsaserve.kernels.triton_sparse_mla import sparse_mla_decode

    heads, rank, rope, width = 16, 256, 32, 300
    g = torch.Generator().manual_seed(40 + tokens + fp8)
    num_slots = tokens * width + 5
    cache = fmt.alloc_latent(num_slots, rank, rope, fp8, torch.bfloat16, "cpu")
    fmt.write_latent(cache, torch.arange(num_slots), torch.randn(num_slots, rank, generator=g),
                     torch.randn(num_slots, rope, generator=g))  # fmt: skip
    lens = torch.randint(1, width + 1, (tokens,), generator=g)
    lens[0] = width
    cols = torch.arange(width)
    slots = torch.randperm(num_slots, generator=g)[: tokens * width].view(tokens, width)
    slots = torch.where(cols[None, :] < lens[:, None], slots, -1)
    q_lat = torch.randn(tokens, heads, rank, generator=g).bfloat16()
    q_pe = torch.randn(tokens, heads, rope, generator=g).bfloat16()
    want = sparse_mla_torch(q_lat, q_pe, cache, slots, 0.0625)
    # 4 programs: few rows get several parts (a merge), more rows one part each, longest first.
    work = plan_mla_work(lens, width, programs=4, block=32)
    assert (work.max_parts > 1) == (tokens < 4)
    got = sparse_mla_decode(q_lat, q_pe, cache, slots, 0.0625, block_n=32, work=work)
    assert float((got - want).norm() / want.norm()) < 1e-2
