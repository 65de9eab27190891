"""The kernel warm-up (worker/warmup.py): its steps cover the shape buckets it names and stay
inside the pool (each rank's own pages under data-parallel attention), and running them leaves a
model's results unchanged: the garbage they write into the pool is never read as data. Also over
two ranks (gloo), tensor-parallel and with data-parallel attention."""

from pathlib import Path

import numpy as np
import pytest
import torch
from model_helpers import VOCAB, Session, make_checkpoint

from nsaserve.model.runner import ModelRunner
from nsaserve.protocol.validate import request_ranks
from nsaserve.worker.warmup import EVEN_CONTEXT, ODD_CONTEXT, ODD_PROMPT, TOPK_CHUNK, WarmupShape, warm_up, warmup_steps


def by_kind(steps, kind: str):
    return [(name, plan) for name, plan in steps if name.startswith(kind)]


def test_steps_cover_the_buckets_inside_the_pool():
    num_pages, ps = 200, 64
    steps = warmup_steps(WarmupShape(max_tokens=1000, max_batch=100, max_context=100_000), num_pages, ps, vocab_size=50)
    prompts = by_kind(steps, "prompt")
    assert [p.num_tokens for _, p in prompts] == [16, 32, 64, 128, 256, 512, 1000, ODD_PROMPT]
    # Each size after a prefix that takes it past the top-k (2048), but the last, a whole prompt.
    assert [int(p.cached_lens[0]) + p.num_tokens for _, p in prompts] == [4096] * 7 + [ODD_PROMPT]
    # Decode batches past the top-k (2048 by default), where the indexer scores and selects.
    decode = [p for name, p in by_kind(steps, "decode") if name.endswith("at 4095")]
    assert [p.num_reqs for p in decode] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100]
    assert all(p.mode == "decode" and (p.cached_lens == 4095).all() for p in decode)
    # The same batches with a top-k list length (context + 1) that is not a multiple of 16.
    odd = [p for name, p in by_kind(steps, "decode") if name.endswith(f"at {ODD_CONTEXT}")]
    assert [p.num_reqs for p in odd] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100] and (ODD_CONTEXT + 1) % 16
    # And with whole-context lists (within the top-k) whose length is a multiple of 16.
    even = [p for name, p in by_kind(steps, "decode") if name.endswith(f"at {EVEN_CONTEXT}")]
    assert [p.num_reqs for p in even] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100]
    assert (EVEN_CONTEXT + 1) % 16 == 0 and EVEN_CONTEXT + 1 <= 2048
    # Whole prompts (nothing cached) up to the step's limit, within the top-k.
    whole = [p for name, p in steps if name.startswith("whole prompt")]
    assert [p.num_tokens for p in whole] == [128, 256, 512, 1000] and not any(p.cached_lens.any() for p in whole)
    chunks = [p for name, p in steps if " chunks of 32 after " in name]
    assert len(chunks) == 1 and chunks[0].num_reqs == 31 and (chunks[0].cached_lens + 32 > 2048).all()
    # The pool holds 12,800 tokens: one decode past the top-k kernel's single chunk fits.
    long = [p for name, p in steps if name.startswith("decode of 1 at") and int(name.split()[-1]) > TOPK_CHUNK]
    assert len(long) == 1 and long[0].cached_lens[0] > TOPK_CHUNK
    for _, p in steps:
        assert p.page_table.max() < num_pages and p.out_slots.max() < num_pages * ps
        assert (p.positions < num_pages * ps).all() and (p.input_ids < 50).all()
    assert [p.step for _, p in steps] == list(range(len(steps)))


def test_a_small_pool_or_short_context_caps_every_step():
    steps = warmup_steps(WarmupShape(max_tokens=16384, max_batch=4, max_context=100_000), 10, 64, vocab_size=50)
    assert max(p.num_tokens for _, p in by_kind(steps, "prompt")) == 639  # 10 pages of 64, less one
    assert all(p.cached_lens.max() + p.num_tokens // max(1, p.num_reqs) <= 639 for _, p in steps)
    assert not [n for n, _ in steps if n.startswith("decode of 1 at") and int(n.split()[-1]) > TOPK_CHUNK]
    short = warmup_steps(WarmupShape(max_tokens=16384, max_batch=4, max_context=300), 1000, 64, vocab_size=50)
    assert max(int(p.cached_lens.max()) + 1 for _, p in short) <= 299
    assert warmup_steps(WarmupShape(16, 1, 1), 10, 64, vocab_size=50) == []


def test_data_parallel_ranks_each_get_every_request():
    num_pages, dp = 100, 2
    steps = warmup_steps(WarmupShape(max_tokens=256, max_batch=8, max_context=4096), num_pages, 64, 50, dp_size=dp)
    for _, plan in steps:
        ranks = request_ranks(plan, num_pages)
        assert sorted(np.bincount(ranks, minlength=dp).tolist()) == [plan.num_reqs // dp] * dp
        assert len(set(plan.req_ids.tolist())) == plan.num_reqs


def prompt_logits(runner) -> list[torch.Tensor]:
    """Two prompts and two decode steps of a fixed session (scattered pages, as the router)."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (37, 12)]
    s = Session(runner, seed=1)
    out = s.step(list(enumerate(prompts)), all_logits=True)
    for t in range(2):
        out += s.step([(0, [3 + t]), (1, [5 + t])])
    return out


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_warm_up_leaves_results_unchanged(kv, tmp_path):
    make_checkpoint("glm_moe_dsa", str(tmp_path), seed=2)

    def runner():
        return ModelRunner(str(tmp_path), device=torch.device("cpu"), dtype=None, kv_cache_dtype=kv,
                           num_pages=40, page_size=4, show_progress=False)  # fmt: skip

    want = prompt_logits(runner())
    warmed = runner()
    steps, _ = warm_up(warmed, WarmupShape(max_tokens=100, max_batch=6, max_context=warmed.max_context))
    assert steps == len(warmup_steps(WarmupShape(100, 6, warmed.max_context), 40, 4, warmed.vocab_size))
    got = prompt_logits(warmed)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _two_ranks(rank, path, port, result_dir):
    """Rank `rank` of 2 (gloo): for tensor parallel and data-parallel attention, the logits of a
    session on a fresh runner and on one that ran the warm-up first (every rank runs the same
    warm-up steps, so the collectives pair up; a mismatch would hang here)."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for dp in (False, True):
            out = []
            for warm in (False, True):
                r = ModelRunner(path, device=torch.device("cpu"), dtype=None, num_pages=24, page_size=4,
                                show_progress=False, tp_rank=rank, tp_size=2, dp_attention=dp)  # fmt: skip
                if warm:
                    warm_up(r, WarmupShape(max_tokens=40, max_batch=4, max_context=r.max_context, index_topk=8))
                s = Session(r, seed=4, dp_size=2 if dp else 1)
                g = torch.Generator().manual_seed(9)
                prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (19, 7)]
                ranks = {0: 0, 1: 1} if dp else None
                logits = [torch.cat(s.step(list(enumerate(prompts)), all_logits=True, ranks=ranks))]
                for t in range(2):
                    logits.append(torch.stack(s.step([(0, [4 + t]), (1, [8 + t])])))
                out.append(logits)
            for a, b in zip(*out):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        (Path(result_dir) / f"ok{rank}").write_text("ok")
    finally:
        dist.destroy_process_group()


def test_warm_up_under_tensor_parallel_and_dp_attention(tmp_path):
    import torch.multiprocessing as mp
    from test_tensor_parallel import free_port

    path = str(tmp_path / "m")
    make_checkpoint("glm_moe_dsa", path, seed=3, vocab_size=97)
    mp.spawn(_two_ranks, args=(path, free_port(), str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


def test_serve_passes_the_warm_up_shape_to_every_worker_unless_skipped():
    from nsaserve.cli import build_parser
    from nsaserve.serve import worker_command
    from nsaserve.worker.main import parse_args

    def worker_args(*flags):
        args = build_parser().parse_args(["serve", "--model-path=m", "--tp=2", *flags])
        return [parse_args(worker_command(args, r, "/ipc", None, "m", "cuda")[3:]) for r in (0, 1)]

    ranks = worker_args("--max-prefill-tokens=8192", "--max-running-requests=512")
    assert [(a.warmup_tokens, a.warmup_batch) for a in ranks] == [(8192, 512)] * 2
    assert [a.warmup_tokens for a in worker_args("--skip-server-warmup")] == [0, 0]


def test_the_sampler_warm_up_covers_each_kind_of_pick_and_keeps_the_default_generator():
    """The fused pick is specialised on (greedy rows present, a filters' threshold applied) and on
    the logits' dtype, which penalties make float32; the warm-up's batches take every combination
    (each in float32 and the model's dtype), and draw from a generator of their own."""
    from nsaserve.worker.sampler import has_filters
    from nsaserve.worker.sampling_batch import SamplingBatch
    from nsaserve.worker.warmup import sampler_plans, warm_up_sampler

    kinds = set()
    for plan in sampler_plans(page_size=4):
        sb = SamplingBatch.from_plan(plan, "cpu")
        assert not sb.all_greedy  # an all-greedy batch takes argmax, no pick
        if sb.penalty_rows.numel() == 0:  # no penalty: the model's dtype reaches the pick
            kinds.add((sb.any_greedy, has_filters(sb)))
    assert kinds == {(False, True), (True, True), (False, False), (True, False)}
    state = torch.get_rng_state()
    warm_up_sampler(torch.device("cpu"), VOCAB, 4)
    assert torch.equal(state, torch.get_rng_state())
