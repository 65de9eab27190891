"""The graph-safe torch references against the references they stand in for, on random inputs:
the indexer with device row metadata (indexer_rows) against the host-list indexer, in the plan's
packed KV layout and in the padded layout of decode graphs; the dense MoE against the per-expert
one. Also: the registry's graph-safety table names only registered backends."""

import random

import pytest
import torch

from nsaserve.kernels import kv_cache_format as fmt
from nsaserve.kernels.indexer import indexer_topk_torch
from nsaserve.kernels.indexer_rows import indexer_topk_rows_torch
from nsaserve.kernels.moe import moe_experts_torch, route_noaux_tc
from nsaserve.kernels.moe_dense import moe_experts_dense_torch
from nsaserve.kernels.registry import _GRAPH_SAFE, available, graph_safe


def _rows(seq_lens, cached, kv_start):
    kv_off, pos = [], []
    for i, (seq, c) in enumerate(zip(seq_lens, cached)):
        kv_off += [kv_start[i]] * (seq - c)
        pos += range(c, seq)
    return torch.tensor(kv_off), torch.tensor(pos)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_indexer_rows_matches_indexer(fp8, padded):
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    ps, num_pages, heads, dim, topk = 4, 64, 16, 32, 6
    seq_lens, cached = [13, 5, 22, 9], [0, 2, 21, 8]  # prefill, continuation, decodes
    pages = torch.randperm(num_pages, generator=g).tolist()
    span = 24 if padded else None  # the padded layout: request i's positions at i * span
    kv_slots, kv_start = [], []
    for seq in seq_lens:
        kv_start.append(len(kv_slots))
        mine = [pages.pop() for _ in range(-(-seq // ps))]
        kv_slots += [mine[p // ps] * ps + p % ps for p in range(seq)]
        if padded:
            kv_slots += [num_pages * ps - 1] * (span - seq)  # past the end: any slot, masked
    kv_slots = torch.tensor(kv_slots)
    packed = torch.cat([kv_slots[s : s + n] for s, n in zip(kv_start, seq_lens)])
    cache = fmt.alloc_index_k(num_pages, ps, dim, fp8, torch.float32, "cpu")
    fmt.write_index_k(cache, torch.arange(num_pages * ps), torch.randn(num_pages * ps, dim, generator=g), ps)
    qs = [0]
    for seq, c in zip(seq_lens, cached):
        qs.append(qs[-1] + seq - c)
    q, w = torch.randn(qs[-1], heads, dim, generator=g), torch.randn(qs[-1], heads, generator=g)
    want = indexer_topk_torch(q, w, cache, packed, qs, cached, seq_lens, topk, dim**-0.5, ps)
    kv_off, pos = _rows(seq_lens, cached, kv_start)
    got = indexer_topk_rows_torch(q, w, cache, kv_slots, kv_off, pos, span or max(seq_lens), topk, dim**-0.5, ps)
    assert torch.equal(got, want), seed


def test_dense_moe_matches_per_expert_moe():
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    tokens, hidden, inter, experts, first, local = 9, 16, 8, 8, 2, 4
    x = torch.randn(tokens, hidden, generator=g)
    w, ids = route_noaux_tc(torch.randn(tokens, experts, generator=g), torch.zeros(experts), 3, 1, 1, True, 2.5)
    w13 = torch.randn(local, 2 * inter, hidden, generator=g)
    w2 = torch.randn(local, hidden, inter, generator=g)
    want = moe_experts_torch(x, ids, w, w13, w2, first)
    got = moe_experts_dense_torch(x, ids, w, w13, w2, first)
    # float32 sums in another order: an output that cancels to near 0 from terms of ~100 is off
    # by ~1e-5 (seed 601627336), so the absolute tolerance follows the outputs' scale.
    atol = 2e-6 * float(want.abs().max())
    assert torch.allclose(got, want, rtol=1e-5, atol=atol), seed


def test_graph_safe_table_names_registered_backends():
    available("attention")  # loads the built-in backends
    for kind, name in _GRAPH_SAFE:
        assert name in available(kind), (kind, name)
    assert not graph_safe("moe_experts", "torch")
    # An indexer backend is captured through its indexer_rows form.
    for name in available("indexer"):
        assert graph_safe("indexer", name) == (name in available("indexer_rows"))
