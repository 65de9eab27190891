"""The warp-specialised Gluon sparse MLA decode (Hopper only) against the torch reference and the
lock-step Gluon kernel, on fresh random inputs at GLM-5 / DeepSeek-V3.2 shapes. Skipped without a
Hopper GPU (tests/kernels/compile_sm90.py compiles it on any machine). The output dtype and CUDA-graph
replay tests run both Gluon kernels in test_gluon_sparse_mla.py."""

import pytest
import torch

pytest.importorskip("triton")

from test_gluon_sparse_mla import HOPPER, RANK, SCALE, TOPK, case  # noqa: E402
from test_triton_sparse_mla import rel_err  # noqa: E402

from nsaserve.kernels import triton_sparse_mla  # noqa: E402
from nsaserve.kernels.gluon_sparse_mla import sparse_mla_decode_gluon  # noqa: E402
from nsaserve.kernels.gluon_sparse_mla_ws import sparse_mla_decode_ws, supports, takes_shapes  # noqa: E402
from nsaserve.kernels.registry import get_backend  # noqa: E402
from nsaserve.kernels.sparse_mla import sparse_mla_torch  # noqa: E402

hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel needs a Hopper GPU")


@hopper
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_matches_reference_and_lock_step_kernel(fp8, heads, num_splits):
    (q_lat, q_pe, cache, slots), want = case(5, heads, fp8, seed=heads + fp8 + (num_splits or 0))
    assert supports(q_lat, q_pe, cache)
    got = sparse_mla_decode_ws(q_lat, q_pe, cache, slots, SCALE, num_splits=num_splits)
    lock_step = sparse_mla_decode_gluon(q_lat, q_pe, cache, slots, SCALE, num_splits=num_splits)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert rel_err(got.cpu(), want) < 1e-2  # bf16 operands (P and, for fp8, the dequantised latent)
    # The same operands and the same order of sums within a block as the lock-step kernel.
    assert rel_err(got, lock_step) < 1e-5


@hopper
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tokens", [1, 64, 200])
def test_batch_sizes_of_decode(fp8, tokens):
    """One token (every multiprocessor on one list: 16 splits of 128 entries), a full wave of
    splits, and more programs than multiprocessors (no splits)."""
    (q_lat, q_pe, cache, slots), want = case(tokens, 64, fp8, seed=tokens)
    got = sparse_mla_decode_ws(q_lat, q_pe, cache, slots, SCALE)
    assert rel_err(got.cpu(), want) < 1e-2


@hopper
@pytest.mark.parametrize("fp8", [False, True])
def test_q_copied_in_the_partition_changes_no_bit(fp8):
    """q into shared memory by the softmax partition (q_here) or before the partitions start."""
    (q_lat, q_pe, cache, slots), _ = case(70, 64, fp8, seed=3)
    want = sparse_mla_decode_ws(q_lat, q_pe, cache, slots, SCALE, q_here=False)
    assert torch.equal(sparse_mla_decode_ws(q_lat, q_pe, cache, slots, SCALE, q_here=True), want)


@hopper
@pytest.mark.parametrize("fp8", [False, True])
def test_trimmed_rows(fp8):
    """Rows -1 padded after their valid entries (a decode graph's context bucket) match the
    reference with and without trim, with and without splits; -1 entries inside a block too."""
    (q_lat, q_pe, cache, slots), _ = case(4, 64, fp8, seed=7)
    for t, n in enumerate([TOPK, 1000, 1, 65]):
        slots[t, n:] = -1
    slots[0, 100:170:3] = -1
    want = sparse_mla_torch(q_lat.cpu(), q_pe.cpu(), cache.cpu(), slots.cpu(), SCALE)
    for trim in (False, True):
        for num_splits in (None, 1):
            got = sparse_mla_decode_ws(q_lat, q_pe, cache, slots, SCALE, num_splits=num_splits, trim=trim)
            assert rel_err(got.cpu(), want) < 1e-2, (trim, num_splits)


@hopper
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tokens", [3, 64, 200])
def test_work_plans(fp8, tokens):
    """Whole-context rows of mixed lengths through a work plan (kernels/mla_work.py: rows cut into
    parts, longest first, merged by counts; 200 rows: one part a row, written directly), in both
    Gluon kernels: the reference's results."""
    from nsaserve.kernels.mla_work import plan_mla_work

    (q_lat, q_pe, cache, slots), _ = case(tokens, 64, fp8, seed=11 + tokens)
    g = torch.Generator().manual_seed(tokens)
    lens = torch.randint(1, TOPK + 1, (tokens,), generator=g)
    lens[0] = TOPK
    cols = torch.arange(TOPK)
    slots = torch.where(cols[None, :] < lens[:, None], slots.cpu(), -1).to(slots.device)
    want = sparse_mla_torch(q_lat.cpu(), q_pe.cpu(), cache.cpu(), slots.cpu(), SCALE)
    work = plan_mla_work(lens.to(slots.device), TOPK, torch.cuda.get_device_properties(0).multi_processor_count)
    assert (work.max_parts > 1) == (tokens < 132)
    for run in (sparse_mla_decode_ws, sparse_mla_decode_gluon):
        got = run(q_lat, q_pe, cache, slots, SCALE, work=work, out_dtype=torch.bfloat16)
        assert rel_err(got.float().cpu(), want) < 1e-2, run.__name__


def replayed_on_new_lengths(tokens: int, plan, seed: int):
    """plan(lens) -> the kernel's keyword arguments (a work plan or a row order, torch ops on the
    device), captured once with the kernel in a CUDA graph and replayed on other context lengths
    (each row's first lens[t] entries valid): the reference's results each time."""
    (q_lat, q_pe, cache, full), _ = case(tokens, 64, True, seed=seed)
    lens = torch.full((tokens,), TOPK, dtype=torch.int32, device="cuda")
    slots = full.clone()
    cols = torch.arange(TOPK, device="cuda")

    def step():
        return sparse_mla_decode_ws(q_lat, q_pe, cache, slots, SCALE, out_dtype=torch.bfloat16, **plan(lens))

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    g = torch.Generator().manual_seed(seed + 4)
    for _ in range(2):
        new = torch.randint(1, TOPK + 1, (tokens,), generator=g, dtype=torch.int32).cuda()
        lens.copy_(new)
        slots.copy_(torch.where(cols[None, :] < new[:, None], full, -1))
        out.fill_(float("nan"))
        graph.replay()
        want = sparse_mla_torch(q_lat.cpu(), q_pe.cpu(), cache.cpu(), slots.cpu(), SCALE)
        assert rel_err(out.float().cpu(), want) < 1e-2


@hopper
def test_work_plan_in_a_cuda_graph():
    from nsaserve.kernels.mla_work import plan_mla_work

    programs = torch.cuda.get_device_properties(0).multi_processor_count
    replayed_on_new_lengths(64, lambda lens: {"work": plan_mla_work(lens, TOPK, programs)}, seed=5)


@hopper
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tokens", [3, 64, 200, 300])
@pytest.mark.parametrize("whole", [True, False])
def test_row_order(fp8, tokens, whole):
    """Rows of mixed lengths in a shuffled order run longest first with their counts
    (kernels/mla_rows.py; 3 and 64 rows with splits, 200 and 300 without), whole contexts and
    top-k lists of longer contexts, in both Gluon kernels: the reference's results, and the
    same as the trimmed kernels'."""
    from nsaserve.kernels.mla_rows import plan_row_order

    (q_lat, q_pe, cache, slots), _ = case(tokens, 64, fp8, seed=21 + tokens + whole)
    g = torch.Generator().manual_seed(tokens + 2 * fp8)
    row_pos = torch.randint(0, TOPK if whole else 3 * TOPK, (tokens,), generator=g)
    row_pos[0] = TOPK - 1
    n = (row_pos + 1).clamp(max=TOPK)
    cols = torch.arange(TOPK)
    slots = torch.where(cols[None, :] < n[:, None], slots.cpu(), -1).to(slots.device)
    want = sparse_mla_torch(q_lat.cpu(), q_pe.cpu(), cache.cpu(), slots.cpu(), SCALE)
    rows = plan_row_order(row_pos.cuda(), TOPK)
    for run in (sparse_mla_decode_ws, sparse_mla_decode_gluon):
        got = run(q_lat, q_pe, cache, slots, SCALE, rows=rows, out_dtype=torch.bfloat16)
        trimmed = run(q_lat, q_pe, cache, slots, SCALE, trim=True, out_dtype=torch.bfloat16)
        assert rel_err(got.float().cpu(), want) < 1e-2, run.__name__
        # The same programs' sums, for other rows: the same bits as the trimmed kernel.
        assert torch.equal(got, trimmed), run.__name__


@hopper
def test_row_order_in_a_cuda_graph():
    """The order (a sort on the device: row t's position is lens[t] - 1) in the graph."""
    from nsaserve.kernels.mla_rows import plan_row_order

    replayed_on_new_lengths(256, lambda lens: {"rows": plan_row_order(lens - 1, TOPK)}, seed=6)


@hopper
@pytest.mark.parametrize("mode", ["auto", "all", "none"])
@pytest.mark.parametrize(("fp8", "tokens"), [(False, 5), (True, 5), (True, 130), (True, 300), (False, 300), (False, 1)])
def test_registry_backend_routes_calls(monkeypatch, mode, fp8, tokens):
    """Calls go to this kernel by WS_MODE and WS_FROM_TOKENS (the cache's least token count), loops
    trimmed as the lock-step kernel's; prompt chunks (PREFILL_TOKENS and more) without splits."""
    (q_lat, q_pe, cache, slots), want = case(tokens, 64, fp8, seed=5)
    calls = []
    real = sparse_mla_decode_ws

    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr("nsaserve.kernels.gluon_sparse_mla_ws.sparse_mla_decode_ws", spy)
    monkeypatch.setattr(triton_sparse_mla, "KERNEL", "gluon")
    monkeypatch.setattr(triton_sparse_mla, "WS_MODE", mode)
    got = get_backend("attention", "triton")(q_lat, q_pe, cache, slots, SCALE, whole_contexts=True)
    least = {"auto": triton_sparse_mla.WS_FROM_TOKENS["fp8" if fp8 else "bf16"], "all": 2, "none": 10**9}[mode]
    assert len(calls) == (tokens >= least) and all(kw["trim"] is True for kw in calls)
    assert all(kw.get("num_splits") == (1 if tokens >= triton_sparse_mla.PREFILL_TOKENS else None) for kw in calls)
    assert got.dtype == q_lat.dtype and rel_err(got.float().cpu(), want) < 1e-2


def test_shape_rule():
    """What the kernel takes, checked on any machine."""
    bf16, u8 = torch.bfloat16, torch.uint8
    assert takes_shapes(64, RANK, 64, bf16, bf16, u8) and takes_shapes(128, RANK, 64, bf16, bf16, bf16)
    assert not takes_shapes(16, RANK, 64, bf16, bf16, u8)  # tensor-parallel ranks with fewer heads
    assert not takes_shapes(64, 256, 64, bf16, bf16, u8) and not takes_shapes(64, RANK, 32, bf16, bf16, u8)
    assert not takes_shapes(64, RANK, 64, torch.float16, torch.float16, u8)
