"""Data-parallel attention at N=2 (two processes, gloo) gives, on every rank, the logits of TP=1.

Each rank holds the whole attention and its own pool of P pages; the plans address N * P global
pages, requests on rank 1 having pages offset by P. The reference runs each rank's requests on its
own TP=1 runner with local page ids, and puts the logit rows back in plan order. The steps cover
prefill, decode and mixed batches, a plan order that interleaves the ranks, a step where one rank
has no request, sampling and prompt-logprob rows in one step, a step without logit rows (its KV is
read by the last step), and a request whose pages straddle
the ranks (it fails alone through the worker's own plan handling; the rest of its step runs).
"""

import os
from dataclasses import replace

import numpy as np
import pytest
import torch
from model_helpers import Session, make_checkpoint, rel_err
from test_tensor_parallel import MODEL_TYPES, TP_VOCAB, spawn_gloo

from nsaserve.model.runner import ModelRunner
from nsaserve.protocol.messages import encode_plan
from nsaserve.protocol.validate import select
from nsaserve.worker.main import run_plan
from nsaserve.worker.model_executor import ModelExecutor
from nsaserve.worker.prev_step import PrevStep

N, P, PAGE = 2, 16, 4
STRADDLER = 99


def runner_kw():
    return dict(device=torch.device("cpu"), dtype=None, num_pages=P, page_size=PAGE, show_progress=False)


class ReferenceDP:
    """N TP=1 runners, one per rank: each runs its rank's requests with local page ids; the logit
    rows come back in the combined plan's order (sampling rows, then prompt-logprob rows)."""

    def __init__(self, path):
        self.runners = [ModelRunner(path, **runner_kw()) for _ in range(N)]
        self.page_size, self.num_pages, self.device = PAGE, P, torch.device("cpu")

    def forward_plan(self, plan):
        rank = plan.page_table[plan.page_start[:-1]].astype(np.int64) // P
        qlen = np.diff(plan.query_start)
        sampled, prompt = {}, {}
        for r, runner in enumerate(self.runners):
            keep = rank == r
            if not keep.any():
                continue
            sub = select(plan, keep)
            sub = replace(sub, page_table=sub.page_table - r * P, out_slots=sub.out_slots - r * P * PAGE)
            logits, row = runner.forward_plan(sub), 0
            for i in np.flatnonzero(keep):
                if plan.sample[i]:
                    sampled[i], row = logits[row], row + 1
            for i in np.flatnonzero(keep):
                if plan.prompt_logprobs[i]:
                    prompt[i], row = logits[row : row + qlen[i]], row + qlen[i]
            assert row == logits.shape[0]
        rows = [sampled[i][None] for i in sorted(sampled)] + [prompt[i] for i in sorted(prompt)]
        return torch.cat(rows) if rows else torch.zeros(0, TP_VOCAB)


def tokens(seed, n):
    return torch.randint(0, TP_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_scenario(runner, executor=None):
    """The steps below on `runner` (a DP rank, or ReferenceDP); the logits of every step, in plan
    order. executor: the rank's ModelExecutor, for the step run through the worker's plan handling."""
    s = Session(runner, seed=3, dp_size=N)
    out = []

    def step(work, all_logits=False, ranks=None):
        s.step(work, all_logits, ranks)
        out.append(s.last_logits)

    # Prefill, the ranks interleaved in plan order; request 0 wants prompt logprobs, 1 and 2 sample.
    step([(0, tokens(1, 11)), (1, tokens(2, 9)), (2, tokens(3, 6))], {0}, ranks={0: 1, 1: 0, 2: 1})
    assert s.last_plan.mode == "prefill"
    step([(0, [5]), (1, [6]), (2, [7])])  # decode on both ranks
    # Mixed: a new prompt on rank 0 (with prompt logprobs) among decodes of both ranks.
    step([(2, [8]), (3, tokens(4, 7)), (1, [9])], {3}, ranks={3: 0})
    assert s.last_plan.mode == "mixed"
    step([(0, [10]), (2, [11])])  # rank 0 has no request this step
    step([(3, [12]), (1, [13])])  # rank 1 has no request this step
    step([(4, tokens(5, 5))], ranks={4: 1})  # a lone prefill on rank 1
    # A prompt chunk that samples nothing (no logit rows at all) beside a decode: KV only.
    work = [(5, tokens(7, 6)), (4, [21])]
    plan = s.plan(work, False, ranks={5: 0})
    out.append(runner.forward_plan(replace(plan, sample=np.zeros_like(plan.sample))))
    for rid, toks in work:
        s.reqs[rid].cached += len(toks)

    # A request whose pages straddle the ranks fails alone; the others of its step run.
    work = [(1, [14]), (STRADDLER, tokens(6, 6)), (0, [15])]
    plan = s.plan(work, False, ranks={STRADDLER: 0})
    i = list(plan.req_ids).index(STRADDLER)
    pt = plan.page_table.copy()
    pt[plan.page_start[i] + 1] = s.free_by_rank[1][-1]  # its second page (positions 4, 5) on rank 1
    plan = replace(plan, page_table=pt)
    if executor is None:
        runnable = select(plan, plan.req_ids != STRADDLER)
        errors = [(STRADDLER, "")]
        out.append(runner.forward_plan(runnable))
    else:
        captured = []
        forward_plan = executor.runner.forward_plan
        executor.runner.forward_plan = lambda p, *rest: captured.append(forward_plan(p, *rest)) or captured[-1]
        result, _ = run_plan(encode_plan(plan), executor, executor.runner.tp.rank == 0, PrevStep(False))
        executor.runner.forward_plan = forward_plan
        errors = result.errors
        if executor.runner.tp.rank == 0:
            assert sorted(rid for rid, _, _ in result.sampled) == [0, 1]
        out.append(captured[0])
    assert [e[0] for e in errors] == [STRADDLER], errors
    assert executor is None or "span more than one rank" in errors[0][1]
    for rid, toks in work:
        if rid != STRADDLER:
            s.reqs[rid].cached += len(toks)

    step([(4, [16]), (3, [17]), (5, [22]), (2, [18]), (1, [19]), (0, [20])])  # everyone decodes after it
    return out


def _worker(rank, paths, result_dir):
    for i, path in enumerate(paths):
        runner = ModelRunner(path, tp_rank=rank, tp_size=N, dp_attention=True, **runner_kw())
        executor = ModelExecutor(runner, runner.device)
        assert executor.dp_size == N and executor.num_pages == P and runner.pool.num_pages == P
        torch.save(run_scenario(runner, executor), os.path.join(result_dir, f"{i}-rank{rank}.pt"))


def test_dp_attention_equals_tp1_per_rank(tmp_path):
    paths = [str(tmp_path / t) for t in MODEL_TYPES]
    for t, path in zip(MODEL_TYPES, paths):
        make_checkpoint(t, path, seed=2, vocab_size=TP_VOCAB)
    spawn_gloo(_worker, N, paths, str(tmp_path))
    for i, path in enumerate(paths):
        want = run_scenario(ReferenceDP(path))
        got = [torch.load(tmp_path / f"{i}-rank{r}.pt") for r in range(N)]
        assert len(got[0]) == len(got[1]) == len(want) == 9
        for k, ref in enumerate(want):
            assert got[0][k].shape == ref.shape and (ref.shape[0] > 0) == (k != 6), (MODEL_TYPES[i], k)
            assert torch.equal(got[0][k], got[1][k]), f"{MODEL_TYPES[i]} step {k}: ranks must agree"
            assert ref.shape[0] == 0 or rel_err(got[0][k], ref) < 1e-5, (MODEL_TYPES[i], k)


def test_dp_attention_holds_whole_attention_and_split_mlps(tmp_path):
    """Built for rank 1 of 2 without a process group (nothing runs): all heads, no tp_shard on the
    attention weights, MLPs, experts and lm_head split as under TP."""
    path = str(tmp_path / "m")
    make_checkpoint("glm_moe_dsa", path, seed=2, vocab_size=TP_VOCAB)
    dp = ModelRunner(path, tp_rank=1, tp_size=2, dp_attention=True, **runner_kw())
    tp = ModelRunner(path, tp_rank=1, tp_size=2, **runner_kw())
    one = ModelRunner(path, **runner_kw())
    for a, b, c in zip(dp.model.model.layers, tp.model.model.layers, one.model.model.layers):
        assert a.self_attn.heads == c.self_attn.heads == 2 * b.self_attn.heads
        for name in ("q_b_proj", "kv_b_proj", "o_proj"):
            w = getattr(a.self_attn, name).weight
            assert w.tp_shard is None and torch.equal(w, getattr(c.self_attn, name).weight)
        assert a.self_attn.tp.size == 1 and a.mlp.tp.size == 2
        for (name, x), (_, y) in zip(a.mlp.state_dict().items(), b.mlp.state_dict().items()):
            assert torch.equal(x, y), name
    assert torch.equal(dp.model.lm_head.weight, tp.model.lm_head.weight)
    with pytest.raises(RuntimeError, match="forward_plan"):
        dp.forward(None)
    with pytest.raises(ValueError, match="tp_size >= 2"):
        ModelRunner(path, dp_attention=True, **runner_kw())


def test_the_flag_reaches_every_worker_and_needs_tp2():
    """serve --enable-dp-attention: every worker gets it (page ids then span tp pools in its plan
    validation); serve refuses it at --tp 1. Decode graphs under it: tests/model/test_cuda_graphs_tp.py."""
    from nsaserve.cli import build_parser
    from nsaserve.serve import ServeError, Supervisor, worker_command
    from nsaserve.worker.main import build_executor, parse_args

    def worker_args(flags, rank):
        args = build_parser().parse_args(["serve", "--model-path=m", *flags])
        return parse_args(worker_command(args, rank, "/ipc", None, "m", "cpu")[3:])

    assert [worker_args(["--tp=2", "--enable-dp-attention"], r).enable_dp_attention for r in (0, 1)] == [True] * 2
    assert not worker_args(["--tp=2"], 0).enable_dp_attention
    null = worker_args(["--tp=2", "--enable-dp-attention", "--model-executor=null"], 1)
    assert build_executor(null).dp_size == 2
    with pytest.raises(ServeError, match="needs --tp >= 2"):
        Supervisor(build_parser().parse_args(["serve", "--enable-dp-attention"])).start()

