"""Triton lightning indexer (logits + exact top-k) for decode at GLM-5 shapes on one GPU.

    PYTHONPATH=pyworker python bench/kernels/bench_indexer.py [--out bench/results]

One query row per request (32 heads x 128, top-k 2048, pages of 64), fp8 (DeepGEMM's 132-byte
paged layout) and bf16 key caches, batch 1..256, context 4K and 8K. Times are CUDA-graph replays of
the device-only path (`indexer_topk_rows`), rotating over enough cache copies that the keys do not
sit in L2; "logits" is the first kernel alone. The roofline is the fewest bytes (keys, their slot
ids, the queries) over the copy bandwidth measured in the same run. Targets: <= 20 us at batch 1
and <= 40 us at batch 64 with 4K context.
"""

from __future__ import annotations

import argparse
import math

import torch
from bench_common import bf16_matmul_rate, copy_bandwidth, eager_time_us, graph_time_us, print_table, write_results

from nsaserve.kernels import kv_cache_format as fmt
from nsaserve.kernels.triton_indexer import indexer_logits, indexer_topk_rows, indexer_topk_triton

HEADS, DIM, TOPK, PAGE = 32, 128, 2048, 64
L2_BYTES = 60 << 20


def build(batch: int, ctx: int, fp8: bool, copies: int):
    """One key cache holding `copies` independent batches, their pages scattered."""
    num_pages = copies * batch * ctx // PAGE
    cache = fmt.alloc_index_k(num_pages, PAGE, DIM, fp8, torch.bfloat16, "cuda")
    pages = torch.randperm(num_pages, device="cuda")
    kv_slots = (pages[:, None] * PAGE + torch.arange(PAGE, device="cuda")).flatten()
    for s in range(0, kv_slots.numel(), 1 << 20):  # random keys, written in chunks to bound memory
        part = kv_slots[s : s + (1 << 20)]
        fmt.write_index_k(cache, part, torch.randn(part.numel(), DIM, device="cuda"), PAGE)
    row_pos = torch.full((batch,), ctx - 1, dtype=torch.int32, device="cuda")
    sets = []
    for c in range(copies):
        row_kv_off = (c * batch + torch.arange(batch, device="cuda", dtype=torch.int32)) * ctx
        q = torch.randn(batch, HEADS, DIM, device="cuda")
        w = torch.randn(batch, HEADS, device="cuda") * HEADS**-0.5
        sets.append((q, w, row_kv_off))
    return cache, kv_slots, row_pos, sets


def run_case(batch: int, ctx: int, fp8: bool, copy_bps: float) -> dict:
    key_bytes = DIM + 4 if fp8 else 2 * DIM
    min_bytes = batch * ctx * (key_bytes + 8) + batch * HEADS * (DIM + 1) * 4
    copies = max(2, min(128, math.ceil(4 * L2_BYTES / min_bytes)))
    cache, kv_slots, row_pos, sets = build(batch, ctx, fp8, copies)
    scale = DIM**-0.5

    def full(q, w, off):
        return lambda: indexer_topk_rows(q, w, cache, kv_slots, off, row_pos, ctx, TOPK, scale, PAGE)

    def logits(q, w, off):
        return lambda: indexer_logits(q, w, cache, kv_slots, off, row_pos, ctx, scale, PAGE)

    t_full = graph_time_us([full(*s) for s in sets])
    t_logits = graph_time_us([logits(*s) for s in sets])
    # The registry backend as the model calls it: host lists -> row metadata -> both kernels.
    q, w, _ = sets[0]
    ones = list(range(batch + 1))
    t_eager = eager_time_us(
        lambda: indexer_topk_triton(q, w, cache, kv_slots, ones, [ctx - 1] * batch, [ctx] * batch, TOPK, scale, PAGE)
    )
    floor_us = min_bytes / copy_bps * 1e6
    return {
        "cache": "fp8" if fp8 else "bf16",
        "batch": batch,
        "ctx": ctx,
        "us": t_full,
        "logits_us": t_logits,
        "topk_us": t_full - t_logits,
        "eager_us": t_eager,
        "GBps": min_bytes / (t_full * 1e-6) / 1e9,
        "floor_us": floor_us,
        "roofline_frac": floor_us / t_full,
        "copies": copies,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    torch.manual_seed(0)
    ceilings = {"copy_TBps": copy_bandwidth() / 1e12, "bf16_TFLOPs": bf16_matmul_rate() / 1e12}
    rows = []
    for fp8 in (True, False):
        for batch, ctx in ((1, 4096), (8, 4096), (64, 4096), (256, 4096), (1, 8192), (64, 8192)):
            rows.append(run_case(batch, ctx, fp8, ceilings["copy_TBps"] * 1e12))
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()  # the case's buffers are gone with its frame
    cols = ["cache", "batch", "ctx", "us", "logits_us", "topk_us", "eager_us", "GBps", "floor_us", "roofline_frac"]
    notes = (
        "us: CUDA-graph replay of logits + top-k (device-only path); eager_us: the registry backend "
        "called back to back from Python (host metadata and launches included). Targets: <= 20 us "
        "at batch 1 and <= 40 us at batch 64, 4K context."
    )
    write_results("triton-indexer", args.out, ceilings, rows, cols, notes)
    print(f"copy {ceilings['copy_TBps']:.2f} TB/s, bf16 matmul {ceilings['bf16_TFLOPs']:.0f} TFLOP/s")
    print_table(rows, cols)


if __name__ == "__main__":
    main()
