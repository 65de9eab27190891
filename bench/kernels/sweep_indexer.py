"""Launch-parameter sweep of the Triton indexer's two kernels (fp8 keys, 4K context, batch 1 and 64).

    PYTHONPATH=pyworker python bench/kernels/sweep_indexer.py

Prints one line per variant: logits kernel (block_n, num_warps, programs wanted) and top-k kernel
(num_warps), each timed alone as CUDA-graph replays over rotating buffers.
"""

from __future__ import annotations

from functools import partial

import torch
from bench_common import graph_time_us
from bench_indexer import PAGE, TOPK, build

from nsaserve.kernels.triton_indexer import indexer_logits, topk_of_logits


def main() -> None:
    torch.manual_seed(0)
    ctx, scale = 4096, 128**-0.5
    for batch, copies in ((1, 64), (64, 4)):
        cache, kv_slots, row_pos, sets = build(batch, ctx, True, copies)
        for bn, warps, want in ((64, 4, 264), (64, 4, 528), (128, 4, 264), (128, 8, 264), (64, 8, 264)):
            opts = {"block_n": bn, "num_warps": warps, "programs_wanted": want}
            calls = [
                partial(indexer_logits, q, w, cache, kv_slots, off, row_pos, ctx, scale, PAGE, **opts)
                for q, w, off in sets
            ]
            us = graph_time_us(calls)
            print(f"batch {batch} logits block_n {bn} warps {warps} programs {want}: {us:.1f} us", flush=True)
        logits = [indexer_logits(q, w, cache, kv_slots, off, row_pos, ctx, scale, PAGE) for q, w, off in sets]
        for warps in (4, 8, 16, 32):
            us = graph_time_us([partial(topk_of_logits, lg, row_pos, TOPK, num_warps=warps) for lg in logits])
            print(f"batch {batch} topk warps {warps}: {us:.1f} us", flush=True)


if __name__ == "__main__":
    main()
