"""Variant sweep of the Triton indexer's kernels (fp8 keys): logits options and top-k digit widths
at 4K decode (batch 1 and 64), and row blocking for an 8K-token prefill.

    PYTHONPATH=pyworker python bench/kernels/sweep_indexer.py [--json out.json]

Each kernel is timed alone as CUDA-graph replays over rotating buffers; one line per variant.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
from bench_common import graph_time_us
from bench_indexer import PAGE, TOPK, build, build_prompt

from nsaserve.kernels.triton_indexer import indexer_logits, row_blocks, topk_of_logits

LOGITS = [  # (name, options)
    ("bf16x3 gather w4", {"split": "bf16x3", "paged": False}),
    ("bf16x3 paged w4", {"split": "bf16x3"}),
    ("fp16x2 paged w4", {"split": "fp16x2"}),
    ("fp16x2 paged w8", {"split": "fp16x2", "num_warps": 8}),
    ("fp16x2 paged w4 p528", {"split": "fp16x2", "programs_wanted": 528}),
]
TOPK_VARIANTS = [  # (bits, warps, sampled)
    (None, 8, False), (8, 8, False), (6, 8, False), (5, 8, False), (4, 8, False), (6, 8, True), (4, 8, True),
]  # fmt: skip
PREFILL = [(4, 4, "fp16x2"), (4, 8, "fp16x2"), (8, 8, "fp16x2"), (4, 4, "fp16")]
# (rows per block, warps, query split)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    ctx, scale = 4096, 128**-0.5
    out = []

    def record(**r):
        out.append(r)
        print(" ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()), flush=True)

    for batch, copies in ((1, 64), (64, 4)):
        cache, kv_slots, row_pos, sets = build(batch, ctx, True, copies)
        for name, opts in LOGITS:
            calls = [
                partial(indexer_logits, q, w, cache, kv_slots, off, row_pos, ctx, scale, PAGE, **opts)
                for q, w, off in sets
            ]
            record(kernel="logits", batch=batch, variant=name, us=graph_time_us(calls))
        logits = [indexer_logits(q, w, cache, kv_slots, off, row_pos, ctx, scale, PAGE) for q, w, off in sets]
        for bits, warps, sampled in TOPK_VARIANTS:
            calls = [
                partial(topk_of_logits, lg, row_pos, TOPK, num_warps=warps, bits=bits, sampled=sampled) for lg in logits
            ]
            name = f"bits {bits} w{warps}" + (" sampled" if sampled else "")
            record(kernel="topk", batch=batch, variant=name, us=graph_time_us(calls))
        del cache, kv_slots, sets, logits
        torch.cuda.empty_cache()

    prompt = 8192
    cache, kv_slots, row_pos, row_kv_off, q, w = build_prompt(prompt, True)
    for rows_per, warps, split in PREFILL:
        blocks = row_blocks([0, prompt], rows_per, "cuda")
        call = partial(
            indexer_logits, q, w, cache, kv_slots, row_kv_off, row_pos, prompt, scale, PAGE,
            split=split, num_warps=warps, row_blocks=blocks,
        )  # fmt: skip
        record(
            kernel="logits",
            batch=f"prefill {prompt}",
            variant=f"rows {rows_per} w{warps} {split}",
            us=graph_time_us([call], reps=10),
        )
    # How often the one-pass fp16 query changes a prefill row's chosen set against the exact split.
    sets = {}
    for split in ("fp16x2", "fp16"):
        lgs = indexer_logits(
            q, w, cache, kv_slots, row_kv_off, row_pos, prompt, scale, PAGE, split=split,
            row_blocks=row_blocks([0, prompt], 4, "cuda"),
        )  # fmt: skip
        sets[split] = topk_of_logits(lgs, row_pos, TOPK, bits=8).sort(dim=1).values
    differ = (sets["fp16x2"] != sets["fp16"]).any(dim=1)
    record(
        kernel="check",
        batch=f"prefill {prompt}",
        variant="fp16 vs fp16x2 rows differing",
        us=float(differ.float().mean()),
    )
    lg = indexer_logits(
        q, w, cache, kv_slots, row_kv_off, row_pos, prompt, scale, PAGE, row_blocks=row_blocks([0, prompt], 4, "cuda")
    )
    for bits, warps, sampled in ((6, 16, False), (8, 16, False), (6, 16, True)):
        call = partial(topk_of_logits, lg, row_pos, TOPK, num_warps=warps, bits=bits, sampled=sampled)
        name = f"bits {bits} w{warps}" + (" sampled" if sampled else "")
        record(kernel="topk", batch=f"prefill {prompt}", variant=name, us=graph_time_us([call], reps=10))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
