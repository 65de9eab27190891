"""Decode step time of the embedded model on one GPU: eager against CUDA-graph replay.

    PYTHONPATH=pyworker python bench/kernels/bench_decode_graphs.py [--out bench/results] [--batches 1,8,32,64]

Each batch size decodes requests holding --context cached tokens (prefilled first). A step is the
worker's forward for one decode plan, timed on the host clock around many steps with a device
synchronisation at the end (what the server pays: host work, launches and GPU time):
- eager torch: build_forward_batch + forward with the torch reference kernels (the default);
- eager: the same with the graph-safe kernel set used for graphs (Triton attention, indexer and
  small ops; dense torch MoE);
- graph: DecodeGraphs.run with that kernel set (pack the plan, one copy, replay, copy logits out).
The floor measured in the same run is the replay's own GPU time (device events around
replays alone, no host work): graph / floor shows what host work and launch gaps remain.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from bench_common import bf16_matmul_rate, copy_bandwidth, print_table, write_results

from nsaserve.protocol.builder import RequestSpec, SamplingSpec, build_plan
from nsaserve.serve import EMBEDDED_MODEL
from nsaserve.worker.batch import build_forward_batch
from nsaserve.worker.cuda_graphs import DecodeGraphs

PAGE = 64
GRAPH_SAFE = {
    "attention": "triton", "indexer": "triton", "rmsnorm": "triton", "rope": "triton",
    "kv_store": "triton", "index_key_store": "triton", "moe_experts": "torch_dense",
}  # fmt: skip


def decode_plan(batch: int, context: int, vocab: int, rng: random.Random):
    """Requests 0..batch-1, each with `context` cached tokens on pages 0.. in request order."""
    per = -(-(context + 1) // PAGE)
    reqs = [
        RequestSpec(i, [rng.randrange(vocab)], context, list(range(i * per, (i + 1) * per)),
                    sampling=SamplingSpec(temperature=0.0))
        for i in range(batch)
    ]  # fmt: skip
    return build_plan(1, PAGE, reqs)


def prefill(runner, batch: int, context: int, vocab: int, rng: random.Random) -> None:
    per = -(-(context + 1) // PAGE)
    for i0 in range(0, batch, 8):
        reqs = [
            RequestSpec(i, [rng.randrange(vocab) for _ in range(context)], 0, list(range(i * per, (i + 1) * per)))
            for i in range(i0, min(batch, i0 + 8))
        ]
        runner.forward(build_forward_batch(build_plan(0, PAGE, reqs), runner.device))


def wall_ms(fn, iters: int) -> float:
    """Median over 5 rounds of host wall time per call, `iters` calls a round, synchronised."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(rounds)


def replay_gpu_ms(graph, iters: int) -> float:
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    e0.record()
    for _ in range(iters):
        graph.replay()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / iters


def main() -> None:
    from nsaserve.model.runner import ModelRunner

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--name", default="decode-graphs")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rng = random.Random(0)
    per = -(-(args.context + 1) // PAGE)
    runner = ModelRunner(
        str(EMBEDDED_MODEL), device=torch.device("cuda"), dtype=None, num_pages=max(batches) * per + 8,
        page_size=PAGE, show_progress=False,
    )  # fmt: skip
    vocab = runner.vocab_size
    for kind, name in GRAPH_SAFE.items():
        runner.set_backend(kind, name)
    prefill(runner, max(batches), args.context, vocab, rng)
    graphs = DecodeGraphs(runner, max_bs=max(batches), max_len=args.context + 1)
    rows = []
    for bs in batches:
        plan = decode_plan(bs, args.context, vocab, rng)
        assert graphs.fits(plan)
        g = graphs._pick(plan)
        row = {"batch": bs, "bucket": g.bs, "context": args.context}
        row["graph_ms"] = wall_ms(lambda plan=plan: graphs.run(plan), args.iters)
        row["replay_gpu_ms"] = replay_gpu_ms(g.graph, args.iters)
        row["eager_ms"] = wall_ms(
            lambda plan=plan: runner.forward(build_forward_batch(plan, runner.device)), args.iters
        )
        saved = dict(runner.model.backends)
        runner.model.backends.update({k: "torch" for k in saved})
        row["eager_torch_ms"] = wall_ms(
            lambda plan=plan: runner.forward(build_forward_batch(plan, runner.device)), args.iters
        )
        runner.model.backends.update(saved)
        row["eager/graph"] = row["eager_ms"] / row["graph_ms"]
        row["graph/floor"] = row["graph_ms"] / row["replay_gpu_ms"]
        print(row, flush=True)  # partial results survive a timeout
        rows.append(row)
    cols = [
        "batch",
        "bucket",
        "context",
        "eager_torch_ms",
        "eager_ms",
        "graph_ms",
        "replay_gpu_ms",
        "eager/graph",
        "graph/floor",
    ]
    notes = (
        f"Embedded model ({runner.config.num_hidden_layers} layers, hidden {runner.config.hidden_size}, "
        f"{runner.dtype}); graph kernels: {GRAPH_SAFE}. {len(graphs.graphs)} graphs captured in "
        f"{graphs.capture_s:.1f} s using {graphs.capture_bytes / 2**20:.0f} MiB. Floor: the replay's GPU time alone."
    )
    ceilings = {"copy_TBps": copy_bandwidth() / 1e12, "bf16_TFLOPs": bf16_matmul_rate() / 1e12}
    stem = write_results(args.name, args.out, ceilings, rows, cols, notes)
    print(notes)
    print(f"results: {stem}.{{json,md}}")
    print_table(rows, cols)


if __name__ == "__main__":
    main()
