"""Median time of one sampler call for batch 1/64/256 at a GLM-5-sized vocabulary.

    PYTHONPATH=pyworker python bench/bench_sampler.py [--device cuda] [--iters 20] [--threads 1]

Mixes: `greedy` (temperature 0), `plain` (temperature 0.7 alone: the pick divides by it),
`top_p` (temperature 1, top-p 0.95: a typical generation_config.json's defaults), `top_k`
(temperature 0.7, top-k 20), `sample` (temperature 0.7, top-k 50, top-p 0.9, min-p 0.05), `full`
(`sample` plus penalties over a 1000-token prompt and 200 generated tokens, seeds, and 5 top
logprobs). Prints one line per (mix, batch); writes nothing.

--stepwise: also time the torch path (penalties, temperature and each filter one after another,
top-p by a sort of the row) beside the default backends (on CUDA the fused threshold + pick).

--graph-rows: the logits are bf16, as decode graphs leave them, and each line also times the
path before 2026-12-02 (a float32 copy of the rows, then the sampler) beside sampling the bf16
rows directly.

--stages: also each stage of `sample` on its own: the uniforms, logit bias + penalties, the
filters' threshold, the pick, and the logprobs (the asked top-k, and the sampled token's alone).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from nsaserve.kernels.registry import get_backend, resolve
from nsaserve.worker.sampler import SamplingBatch, draw_uniform, has_filters, pick_tokens, sample
from nsaserve.worker.sampling_logits import apply_bias_and_penalties
from nsaserve.worker.sampling_logprobs import token_logprobs
from nsaserve.worker.sampling_plans import SamplingRequest, make_plan

VOCAB = 154880


def requests(mix: str, n: int, rng: random.Random) -> list[SamplingRequest]:
    out = []
    for i in range(n):
        if mix == "greedy":
            out.append(SamplingRequest(temperature=0.0))
            continue
        if mix == "plain":
            out.append(SamplingRequest(temperature=0.7))
            continue
        if mix == "top_p":
            out.append(SamplingRequest(temperature=1.0, top_p=0.95))
            continue
        if mix == "top_k":
            out.append(SamplingRequest(temperature=0.7, top_k=20))
            continue
        r = SamplingRequest(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05)
        if mix == "full":
            r.prompt = [rng.randrange(VOCAB) for _ in range(1000)]
            r.generated = [rng.randrange(VOCAB) for _ in range(200)]
            r.repetition_penalty, r.frequency_penalty, r.presence_penalty = 1.1, 0.2, 0.1
            r.seed = i if i % 2 else None
            r.top_logprobs = 5
        out.append(r)
    return out


def timed(fn, device: torch.device, iters: int) -> float:
    times = []
    for _ in range(iters + 1):  # the first call warms up and is dropped
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per case (default 20 on GPU, 3 on CPU)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--mixes", nargs="+", default=["greedy", "plain", "top_p", "top_k", "sample", "full"])
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    ap.add_argument("--graph-rows", action="store_true", help="bf16 logits; also time a float32 copy + sampling")
    ap.add_argument("--stepwise", action="store_true", help="also time the torch (step-by-step) sampling path")
    ap.add_argument("--stages", action="store_true", help="also time each stage of the sampler on its own")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    iters = args.iters or (20 if device.type == "cuda" else 3)
    rng = random.Random(0)
    print(f"device={device} vocab={VOCAB} iters={iters} torch={torch.__version__} threads={torch.get_num_threads()}")
    for mix in args.mixes:
        for S in args.batches:
            plan = make_plan(requests(mix, S, rng))
            logits = torch.randn(S, VOCAB, device=device) * 4
            if args.graph_rows:
                logits = logits.bfloat16()
            sb = SamplingBatch.from_plan(plan, device)
            t_build = timed(lambda plan=plan: SamplingBatch.from_plan(plan, device), device, iters)
            t_sample = timed(lambda logits=logits, sb=sb: sample(logits, sb), device, iters)
            line = f"{mix:>6} batch={S:<4} from_plan {t_build * 1e3:8.3f} ms   sample {t_sample * 1e3:9.3f} ms"
            if args.graph_rows:
                t_copy = timed(
                    lambda logits=logits, sb=sb: sample(logits.to(torch.float32, copy=True), sb), device, iters
                )
                line += f"   float32 copy + sample {t_copy * 1e3:9.3f} ms"
            if args.stepwise:
                t_step = timed(lambda logits=logits, sb=sb: sample(logits, sb, backend="torch"), device, iters)
                line += f"   stepwise {t_step * 1e3:9.3f} ms ({t_step / t_sample:5.1f}x)"
            print(line, flush=True)
            if args.stages:
                print(" " * 7 + stage_times(logits, sb, device, iters), flush=True)


def stage_times(logits: torch.Tensor, sb: SamplingBatch, device: torch.device, iters: int) -> str:
    """ms of each stage of the default (fused where it exists) path, inputs prepared beforehand."""
    V = logits.shape[1]
    out = {"uniforms": timed(lambda: draw_uniform(sb, V, device), device, iters)}
    out["bias+penalties"] = timed(lambda: apply_bias_and_penalties(logits, sb), device, iters)
    x = apply_bias_and_penalties(logits, sb) if sb.adjusts_logits else logits
    u = draw_uniform(sb, V, device)
    th = None
    if u is not None and has_filters(sb):
        find = get_backend("sample_threshold", resolve("sample_threshold", "auto", device.type))
        out["threshold"] = timed(lambda: find(x, sb.temperature, sb.top_k, sb.top_p, sb.min_p), device, iters)
        th = find(x, sb.temperature, sb.top_k, sb.top_p, sb.min_p)
    temp = sb.temperature if u is not None else None
    out["pick"] = timed(lambda: pick_tokens(x, u, sb, temperature=temp, threshold=th), device, iters)
    rows = sb.logprob_rows
    if rows.numel():
        tok = pick_tokens(x, u, sb, temperature=temp, threshold=th).index_select(0, rows)
        lr = logits.index_select(0, rows)
        out[f"logprobs top {sb.max_top_logprobs}"] = timed(
            lambda: token_logprobs(lr, tok, sb.max_top_logprobs), device, iters
        )
        out["logprob alone"] = timed(lambda: token_logprobs(lr, tok, 0), device, iters)
    return "stages: " + "  ".join(f"{k} {v * 1e3:.3f} ms" for k, v in out.items())


if __name__ == "__main__":
    main()
