"""Decode CUDA graphs (worker/cuda_graphs.py).

Everywhere: the bucket rules, which plans fit a graph, and what keeps graphs off (CPU, a backend
that synchronises with the host). On CUDA: for random decode batches of a tiny model, the replayed
graph's logits equal the eager forward's, with torch and Triton kernels, bf16/fp32 KV and FP8 KV;
a step through ModelExecutor samples the same tokens with and without graphs.
"""

import argparse
import os

import numpy as np
import pytest
import torch
from model_helpers import Session, make_checkpoint

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from graph_helpers import compare_graph_to_eager, graph_runner  # noqa: E402

from nsaserve.worker.cuda_graphs import batch_buckets, graph_blockers, len_buckets, plan_fits  # noqa: E402

CUDA = torch.cuda.is_available()
GRAPH_SAFE = {"moe_experts": "torch_dense"}
TRITON = {k: "triton" for k in ("attention", "indexer", "rmsnorm", "rope", "kv_store", "index_key_store")}
# The Triton sparse MLA's q_pe . k_pe product is an MMA, which needs a rope dim of at least 16.
TRITON_DIMS = {"qk_rope_head_dim": 16}


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    # Multiples of 64 past 256: padding a large batch costs little, and each bucket is a capture.
    assert batch_buckets(1024)[-14:] == [240, 256, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896, 960, 1024]
    assert batch_buckets(300) == [1, 2, 4, 8] + list(range(16, 257, 16)) + [300]
    assert len_buckets(128, 4) == [128]
    assert len_buckets(202752, 64) == [1024 << k for k in range(8)] + [202752]
    assert len_buckets(5000, 64) == [1024, 2048, 4096, 5056]  # whole pages


def test_lm_head_writes_into_a_given_buffer(tmp_path):
    """The decode graphs hand lm_head their shared output buffer: it writes the logits there (one
    rank, the model's dtype), with the values it returns otherwise; asked for float32 logits, or
    given a buffer of another shape, it leaves the buffer alone."""
    make_checkpoint("glm_moe_dsa", str(tmp_path), seed=1)
    model = graph_runner(str(tmp_path), "cpu").model
    w = model.lm_head.weight
    h = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
    plain = model._logits(h, float_logits=False)
    out = torch.full((3, w.shape[0]), float("nan"), dtype=w.dtype)
    got = model._logits(h, False, out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, plain, rtol=1e-6, atol=1e-6)
    for kwargs, buf in (({"float_logits": True}, out[:3]), ({"float_logits": False}, out[:2])):
        buf.fill_(float("nan"))
        assert model._logits(h, out=buf, **kwargs).data_ptr() != buf.data_ptr()
        assert buf.isnan().all()


def test_plans_that_fit_and_blockers(tmp_path):
    make_checkpoint("glm_moe_dsa", str(tmp_path), seed=1)
    r = graph_runner(str(tmp_path), "cpu")
    s = Session(r, seed=0)
    s.step([(0, [1, 2, 3]), (1, [4, 5])])
    decode = s.plan([(0, [7]), (1, [8])], all_logits=False)
    assert plan_fits(decode, max_bs=2, max_len=128)
    assert not plan_fits(decode, max_bs=1, max_len=128)  # too many requests
    assert not plan_fits(decode, max_bs=2, max_len=3)  # a context past the largest bucket
    assert not plan_fits(s.plan([(0, [7, 8])], all_logits=False), 2, 128)  # two tokens: not decode
    assert not plan_fits(s.plan([(0, [7])], all_logits=True), 2, 128)  # prompt logprobs
    # --cuda-graph-max-context: contexts past it run eagerly.
    from nsaserve.worker.cuda_graphs import DecodeGraphs

    capped = DecodeGraphs(r, max_bs=2, max_len=4, log=lambda m: None, capture=False)
    assert capped.len_buckets == [4] and capped.fits(decode)
    # --cuda-graph-bs: exactly the listed sizes; the largest is the limit, a batch runs in the next size up.
    listed = DecodeGraphs(r, max_bs=256, log=lambda m: None, capture=False, bs_list=[4, 1])
    assert listed.bs_buckets == [1, 4] and listed.max_bs == 4 and listed._pick(decode, None).bs == 4
    s.step([(0, [7, 8])])
    assert not capped.fits(s.plan([(0, [9]), (1, [8])], all_logits=False))  # request 0 is at 6 tokens
    reasons = " ".join(graph_blockers(r))
    assert "not cuda" in reasons and "moe_experts backend 'torch'" in reasons
    r.set_backend("moe_experts", "torch_dense")
    assert "moe_experts" not in " ".join(graph_blockers(r))


CASES = [
    (torch.float32, "auto", GRAPH_SAFE),
    (torch.float32, "auto", {**GRAPH_SAFE, **TRITON}),
    (torch.bfloat16, "fp8_e4m3", {**GRAPH_SAFE, **TRITON}),
]


# The torch kernels only: the Triton ones in the CPU interpreter take minutes here.
@pytest.mark.parametrize("dtype,kv,backends", [] if CUDA else [CASES[0], (torch.bfloat16, "fp8_e4m3", GRAPH_SAFE)])
def test_static_batch_equals_packed_batch_on_cpu(dtype, kv, backends, tmp_path):
    """Without CUDA: the graphs' static batch (padded rows, fixed KV spans, scratch page, device
    row metadata), run eagerly, gives the logits of the plan's own batch."""
    from nsaserve.worker.cuda_graphs import DecodeGraphs

    make_checkpoint("glm_moe_dsa", str(tmp_path), seed=2, initializer_range=0.06, confident_embedding=0.12)
    r = graph_runner(str(tmp_path), "cpu", dtype, kv, backends)
    graphs = DecodeGraphs(r, max_bs=8, log=lambda m: None)
    assert graphs.out.dtype == dtype  # lm_head's own output; converted to float32 once, after a replay
    compare_graph_to_eager(r, graphs, steps=4, exact=dtype == torch.float32)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype,kv,backends", CASES)
def test_graph_replay_equals_eager(dtype, kv, backends, tmp_path):
    from nsaserve.worker.cuda_graphs import DecodeGraphs

    make_checkpoint(
        "glm_moe_dsa", str(tmp_path), seed=2, initializer_range=0.06, confident_embedding=0.12, **TRITON_DIMS
    )
    r = graph_runner(str(tmp_path), "cuda", dtype, kv, backends)
    assert graph_blockers(r) == []
    graphs = DecodeGraphs(r, max_bs=8, log=lambda m: None)
    compare_graph_to_eager(r, graphs, steps=12, exact=dtype == torch.float32)
    assert graphs.replays == 2 * 12  # each step once as planned, once with patched input tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_executor_samples_the_graph_rows_as_their_float32_copy(tmp_path, monkeypatch, dtype):
    """The executor's graph path hands the sampler the rows in the model's dtype (after a replay, a
    view of the graphs' output buffer) instead of a float32 copy. Through the graphs' static layout
    run eagerly (capture=False, so on any machine): seeded sampling rows, a greedy row and logprobs
    come out as they do from the float32 copy, token for token and number for number."""
    from nsaserve.worker.cuda_graphs import DecodeGraphs
    from nsaserve.worker.model_executor import ModelExecutor

    make_checkpoint("glm_moe_dsa", str(tmp_path), seed=4, initializer_range=0.06, confident_embedding=0.12)
    run_rows = DecodeGraphs.run
    results = []
    for copy in (True, False):
        if copy:  # what the executor received before: a float32 copy of the rows
            monkeypatch.setattr(DecodeGraphs, "run", lambda self, plan, patch=None, float32=True: run_rows(self, plan, patch))
        else:
            monkeypatch.setattr(DecodeGraphs, "run", run_rows)
        r = graph_runner(str(tmp_path), "cpu", dtype, backends=GRAPH_SAFE)
        ex = ModelExecutor(r, r.device, DecodeGraphs(r, max_bs=4, log=lambda m: None, capture=False))
        s = Session(r, seed=5)
        s.step([(0, list(range(20))), (1, list(range(30, 39))), (2, [5, 6])])
        steps = []
        for step in range(5):
            plan = s.plan([(i, [steps[-1][i][0] if steps else i]) for i in range(3)], all_logits=False)
            assert ex.graphs.fits(plan)
            plan.temperature = np.array([0.9, 0.0, 1.3], dtype=np.float32)
            plan.seed = np.array([11 + step, 0, 99 + step], dtype=np.uint64)
            plan.has_seed = np.array([1, 0, 1], dtype=np.uint8)
            plan.top_logprobs = np.array([3, 0, -1], dtype=np.int32)
            out = ex.run(plan, is_rank0=True)
            steps.append({rid: (tok, info) for rid, tok, info in out.sampled})
            for i in range(3):
                s.reqs[i].cached += 1
        results.append(steps)
    assert results[0] == results[1]


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_executor_samples_the_same_with_graphs(tmp_path):
    from nsaserve.worker.model_executor import ModelExecutor, decode_graphs

    make_checkpoint(
        "glm_moe_dsa", str(tmp_path), seed=3, initializer_range=0.06, confident_embedding=0.12, **TRITON_DIMS
    )
    results = []
    for disable in (True, False):
        r = graph_runner(str(tmp_path), "cuda", backends={**GRAPH_SAFE, **TRITON})
        args = argparse.Namespace(disable_cuda_graph=disable, cuda_graph_max_bs=4)
        ex = ModelExecutor(r, r.device, decode_graphs(r, args))
        assert (ex.graphs is None) == disable
        s = Session(r, seed=5)
        s.step([(0, list(range(20))), (1, list(range(30, 39))), (2, [5, 6])])
        tokens = []
        for _ in range(6):
            plan = s.plan([(i, [tokens[-1][i] if tokens else i]) for i in range(3)], all_logits=False)
            plan.temperature = np.zeros_like(plan.temperature)  # greedy
            out = ex.run(plan, is_rank0=True)
            tokens.append({rid: tok for rid, tok, _ in out.sampled})
            for i in range(3):
                s.reqs[i].cached += 1
        results.append(tokens)
        if not disable:
            assert ex.graphs.replays == 6
    assert results[0] == results[1]
