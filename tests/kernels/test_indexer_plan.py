"""The indexer's per-step plan (kernels/indexer_plan.py): built once per forward from the batch and
reused by every layer; the same metadata as the per-call host loops it replaced."""

import random

import torch

from nsaserve.kernels.indexer_plan import plan_from_host, plan_indexer, row_blocks_host, wants_blocks
from nsaserve.model.step_meta import build_step_meta
from nsaserve.protocol.builder import RequestSpec, build_plan
from nsaserve.worker.batch import build_forward_batch


def loops(query_start, cached_lens, seq_lens, rows_per):
    """The per-call Python loops the plan replaces: row offsets, positions, row blocks."""
    kv_off, pos, first, count, off = [], [], [], [], 0
    for i, seq in enumerate(seq_lens):
        n = query_start[i + 1] - query_start[i]
        kv_off += [off] * n
        pos += range(cached_lens[i], cached_lens[i] + n)
        off += seq
        for r in range(query_start[i], query_start[i + 1], rows_per):
            first.append(r)
            count.append(min(rows_per, query_start[i + 1] - r))
    return kv_off, pos, first, count


def random_batch(rng, n):
    new = [rng.choice([0, 1, 1, 3, 7, 20]) for _ in range(n)]
    cached = [rng.randrange(0, 50) for _ in range(n)]
    qs = [0]
    for k in new:
        qs.append(qs[-1] + k)
    return qs, cached, [c + k for c, k in zip(cached, new)]


def test_plan_from_host_matches_the_loops():
    rng = random.Random(3)
    for n in (0, 1, 2, 5, 17):
        for rows_per in (1, 3, 4, 8):
            qs, cached, seqs = random_batch(rng, n)
            kv_off, pos, first, count = loops(qs, cached, seqs, rows_per)
            plan = plan_from_host(qs, cached, seqs, "cpu", rows_per=rows_per)
            assert plan.row_kv_off.tolist() == kv_off and plan.row_pos.tolist() == pos
            assert plan.row_kv_off.dtype == plan.row_pos.dtype == torch.int32
            assert plan.max_len == max(seqs, default=0)
            f, c = row_blocks_host(qs, rows_per)
            assert f.tolist() == first and c.tolist() == count
            if wants_blocks(qs[-1], n):
                assert plan.blocks[0].tolist() == first and plan.blocks[1].tolist() == count
                assert plan.blocks[2] == rows_per
            else:
                assert plan.blocks is None


def test_step_meta_plan_matches_host_plan():
    # Through the worker's own ForwardBatch: a prompt chunk beside decode rows (row blocks), and a
    # decode batch (none).
    ps = 4
    for lens in ([(0, 9), (5, 1), (12, 3)], [(7, 1), (3, 1)]):
        specs, page = [], 0
        for rid, (cached, new) in enumerate(lens):
            pages = list(range(page, page + -(-(cached + new) // ps)))
            page += len(pages)
            specs.append(RequestSpec(id=rid, input_ids=[1] * new, cached_len=cached, pages=pages))
        batch = build_forward_batch(build_plan(0, ps, specs), torch.device("cpu"))
        meta = build_step_meta(batch, torch.ones(2), 1.0)
        want = plan_from_host(batch.query_start_host, batch.cached_lens_host, batch.seq_lens_host, "cpu")
        got = meta.indexer
        assert torch.equal(got.row_kv_off, want.row_kv_off) and torch.equal(got.row_pos, want.row_pos)
        assert got.max_len == want.max_len
        assert (got.blocks is None) == (want.blocks is None)
        if got.blocks is not None:
            assert all(torch.equal(a, b) for a, b in zip(got.blocks[:2], want.blocks[:2]))


def test_plan_without_host_lists_has_no_blocks():
    # CUDA-graph decode: no host boundaries, a fixed span per request.
    pos = torch.tensor([5, 9, 0])
    base = torch.tensor([0, 16, 32])
    plan = plan_indexer(pos, base, 16, None)
    assert plan.blocks is None and plan.max_len == 16
    assert plan.row_pos.tolist() == [5, 9, 0] and plan.row_kv_off.tolist() == [0, 16, 32]
