"""Triton sparse MLA decode (absorbed, d_qk 576, d_v 512, top-2048) on one GPU.

    PYTHONPATH=pyworker python bench/kernels/bench_sparse_mla.py [--out bench/results]

64 heads (GLM-5), fp8 656-byte and bf16 576-wide latent caches, one query token per request, each
selecting 2048 of its 4096 cached positions at random. Every launch variant (CONFIGS: block shape,
pipeline depth, slots loaded a block ahead or not) runs side by side on the same inputs at each
batch size; --warm only compiles them (run in parallel processes first, the on-disk cache is shared).
Times are CUDA-graph replays rotating over enough index/query sets that the selected rows do not
sit in L2; a prefill row runs 2048 query tokens through sparse_mla_prefill. Effective TFLOP/s
counts 2 * heads * 2048 * (576 + 512) per token; the roofline is the larger of FLOPs over the bf16 matmul rate and bytes (selected rows, queries, fp32 output) over the
copy bandwidth, both measured in the same run. Target: >= 250 TFLOP/s at batch >= 64.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from bench_common import bf16_matmul_rate, copy_bandwidth, graph_time_us, print_table, write_results

from nsaserve.kernels import kv_cache_format as fmt
from nsaserve.kernels.gluon_sparse_mla import sparse_mla_decode_gluon
from nsaserve.kernels.gluon_sparse_mla_ws import sparse_mla_decode_ws
from nsaserve.kernels.mla_rows import plan_row_order
from nsaserve.kernels.mla_work import plan_mla_work
from nsaserve.kernels.triton_sparse_mla import sparse_mla_decode, sparse_mla_prefill

RANK, ROPE, TOPK, CTX = 512, 64, 2048, 4096
SCALE = 0.0625
L2_BYTES = 60 << 20
# name -> launch options, all explicit. "default" is the committed launch (decode: slots a block
# ahead, 64 rows, 2 stages; prefill: the same with 32 rows, 4 stages and the loop trimmed); "v2" the
# launch before (the slots loaded in the block that uses them, so the row gather is an indirect load,
# pipelined (num_stages - 1) // 2 blocks ahead; prefill: skip_empty's branch around each block).
# "pf" loads the next block's slots one block ahead: the rows are pipelined num_stages - 1 ahead.
CONFIGS = {
    "default": {},
    "v2": {"prefetch": False, "block_n": 64, "num_stages": 2},
    "n64s3": {"prefetch": False, "block_n": 64, "num_stages": 3},  # the fp8 launch of the v2 results
    "pf-n32s3": {"prefetch": True, "block_n": 32, "num_stages": 3},
    "pf-n32s4": {"prefetch": True, "trim": False, "block_n": 32, "num_stages": 4},
    "n32s5": {"prefetch": False, "block_n": 32, "num_stages": 5},
    "pf-n64s2": {"prefetch": True, "block_n": 64, "num_stages": 2},
    # fp8 only: 64-row blocks 2 ahead (226 KB of shared memory; bf16 would need 288 KB and fails)
    "pf-n64s3": {"prefetch": True, "block_n": 64, "num_stages": 3},
    # one program per (token, head block), no merge: at batch 64 half the SMs idle, no combine pass
    "pf-n64s2-x1": {"prefetch": True, "block_n": 64, "num_stages": 2, "num_splits": 1},
    "pf-n32s3-x1": {"prefetch": True, "block_n": 32, "num_stages": 3, "num_splits": 1},
    # prefill: the loop ended at each list's last valid entry instead of skip_empty's branch per block
    "pf-n32s4-trim": {"prefetch": True, "trim": True, "block_n": 32, "num_stages": 4},
    "pf-n64s2-trim": {"prefetch": True, "trim": True, "block_n": 64, "num_stages": 2},
    # -1 entries: their scale/k_pe loads masked too (else all read slot 0); and the loop trimmed
    "mask": {"mask_all": True},
    "mask-trim": {"mask_all": True, "trim": True},
    # The Gluon decode kernel (gluon_sparse_mla: the warpgroups split QK^T's keys and PV's columns)
    "gluon": {"kernel": "gluon"},
    # The warp-specialised Gluon kernel (gluon_sparse_mla_ws: a softmax warpgroup, a PV warpgroup
    # and a producer warpgroup that gathers and dequantises the next block)
    "gluon-ws": {"kernel": "ws"},
    "gluon-ws-trim": {"kernel": "ws", "trim": True},
    # FP8 dequantisation by bit operations (the warp-specialised kernel's default) against through
    # float32 (the lock-step kernel's)
    "gluon-bits": {"kernel": "gluon", "bits": True},
    "gluon-cvt": {"kernel": "gluon", "bits": False},
    "gluon-ws-cvt": {"kernel": "ws", "bits": False},
    # q copied into shared memory before the partitions start (default: in the softmax partition,
    # while the producer gathers block 0)
    "gluon-ws-qbefore": {"kernel": "ws", "q_here": False},
    "gluon-ws-x1": {"kernel": "ws", "num_splits": 1},
    "gluon-trim": {"kernel": "gluon", "trim": True},
    "gluon-x1": {"kernel": "gluon", "num_splits": 1},
    "gluon-n32": {"kernel": "gluon", "block_n": 32},
    # Splits against the default wave (132 SMs // (tokens x head blocks)): at 64 tokens that is 2
    # splits, 128 programs; 3-4 give more, shorter programs (1.5-2 waves) and a larger combine.
    # Measured slower at 1, 64 and 128 tokens (bench/results/2026-12-02-gluon-sparse-mla-splits).
    "gluon-x2": {"kernel": "gluon", "num_splits": 2},
    "gluon-x3": {"kernel": "gluon", "num_splits": 3},
    "gluon-x4": {"kernel": "gluon", "num_splits": 4},
    # FP8: the next block's rows staged in shared memory by cp.async before the softmax
    # (gluon_sparse_mla.FP8_STAGE), against loads into registers after the PV issue
    "gluon-stage": {"kernel": "gluon", "stage": True},
    "gluon-nostage": {"kernel": "gluon", "stage": False},
    # The next block's copies issued before this block's QK^T, slots loaded a block ahead
    # (gluon_sparse_mla.EARLY_GATHER), against their issue after it
    "gluon-early": {"kernel": "gluon", "early": True},
    "gluon-late": {"kernel": "gluon", "early": False},
    # Rows of mixed lengths (the --spread cases: whole contexts of 819-2048, -1 after): the loops
    # trimmed at each row's end (the registry's launch for such steps), against the step's work plan
    # (kernels/mla_work.py: rows cut into parts, longest first; built inside each timed call here,
    # where the model builds it once a step for all its layers).
    "gluon-ws-plan": {"kernel": "ws", "plan": True},
    "gluon-plan": {"kernel": "gluon", "plan": True},
    # The step's row order (kernels/mla_rows.py: rows launched longest first, each loop ending at
    # its row's count; built once per input set outside the timed call, as the model builds it once
    # a step for all its layers).
    "gluon-ws-order": {"kernel": "ws", "order": True},
    "gluon-order": {"kernel": "gluon", "order": True},
    "order": {"order": True},
}
PREFILL_TOKENS = 2048  # a prompt chunk after CTX cached positions: every row selects a full top-k


def attend(q_lat, q_pe, cache, slots, opts, prefill=False):
    """One call of a config: the Triton kernel (its decode or prefill launch), or the Gluon one for
    {"kernel": "gluon"} (a prefill: no splits, the loop trimmed, as the registry backend calls it)."""
    opts = dict(opts)
    kernel = opts.pop("kernel", "triton")
    if opts.pop("plan", False):  # each row's valid entries lead its list (whole contexts)
        lens = (slots >= 0).sum(1)
        opts["work"] = plan_mla_work(lens, slots.shape[1], torch.cuda.get_device_properties(0).multi_processor_count)
    if opts.pop("order", False):  # unless the caller built it (measure_all does, once per input set)
        opts["rows"] = row_order(slots)
    if kernel == "ws":
        if prefill:
            opts = {"num_splits": 1, "trim": True, **opts}
        return sparse_mla_decode_ws(q_lat, q_pe, cache, slots, SCALE, **opts)
    if kernel == "gluon":
        if prefill:
            opts = {"num_splits": 1, "trim": True, **opts}
        return sparse_mla_decode_gluon(q_lat, q_pe, cache, slots, SCALE, **opts)
    if prefill:
        return sparse_mla_prefill(q_lat, q_pe, cache, slots, SCALE, **opts)
    return sparse_mla_decode(q_lat, q_pe, cache, slots, SCALE, **opts)


def row_order(slots):
    """The row order of lists whose valid entries lead them (a row's count: its valid entries)."""
    return plan_row_order((slots >= 0).sum(1) - 1, slots.shape[1])


def build(batch: int, heads: int, fp8: bool, copies: int):
    num_slots = copies * batch * CTX
    cache = fmt.alloc_latent(num_slots, RANK, ROPE, fp8, torch.bfloat16, "cuda")
    for s in range(0, num_slots, 1 << 19):  # random latents, written in chunks to bound memory
        idx = torch.arange(s, min(num_slots, s + (1 << 19)), device="cuda")
        fmt.write_latent(
            cache, idx, torch.randn(idx.numel(), RANK, device="cuda"), torch.randn(idx.numel(), ROPE, device="cuda")
        )
    kv_slots = torch.randperm(num_slots, device="cuda")  # request r owns kv_slots[r*CTX:(r+1)*CTX]
    sets = []
    for c in range(copies):
        pos = torch.rand(batch, CTX, device="cuda").argsort(dim=1)[:, :TOPK]
        base = (c * batch + torch.arange(batch, device="cuda")) * CTX
        slots = kv_slots[base[:, None] + pos]
        q_lat = torch.randn(batch, heads, RANK, device="cuda", dtype=torch.bfloat16)
        q_pe = torch.randn(batch, heads, ROPE, device="cuda", dtype=torch.bfloat16)
        sets.append((q_lat, q_pe, slots, pos, base))
    return cache, kv_slots, sets


def case_bytes_flops(batch, heads, fp8):
    row_bytes = fmt.latent_fp8_row_bytes(RANK, ROPE) if fp8 else 2 * (RANK + ROPE)
    min_bytes = batch * TOPK * row_bytes + batch * heads * ((RANK + ROPE) * 2 + RANK * 4)
    return min_bytes, 2 * batch * heads * TOPK * (RANK + ROPE + RANK)


def measure_all(
    batch, heads, fp8, names, ceil, prefill=False, causal=False, contiguous=False, half=False, spread=False,
    deadline=None,
) -> list[dict]:  # fmt: skip
    """Every config in names on the same inputs (one cache build), side by side. causal (prefill):
    query row i selects only min(i + 1, top-k) keys, -1 padded, as at the start of a prompt.
    contiguous (a control for the gather): each token reads 2048 physically consecutive rows.
    half (decode of short contexts): the second half of every list is -1 (1024 positions cached).
    spread (decode of serving's mix): each row keeps its first 819-2048 entries (a fixed draw), -1
    after them, as whole contexts of those lengths in a 2048-wide graph bucket."""
    torch.cuda.empty_cache()  # the previous case's buffers are gone with its frame
    min_bytes, flops = case_bytes_flops(batch, heads, fp8)
    copies = 1 if prefill else max(2, min(32, math.ceil(4 * L2_BYTES / min_bytes)))
    cache, kv_slots, sets = build(batch, heads, fp8, copies)
    if causal:
        keep = torch.arange(TOPK, device="cuda")[None, :] <= torch.arange(batch, device="cuda")[:, None]
        sets = [(q_lat, q_pe, torch.where(keep, slots, -1), pos, base) for q_lat, q_pe, slots, pos, base in sets]
        frac = float(keep.float().mean())  # FLOPs and bytes of the valid entries only
        min_bytes, flops = int(min_bytes * frac), flops * frac
    if half:
        tail = torch.arange(TOPK // 2, TOPK, device="cuda")
        sets = [(ql, qp, slots.clone().index_fill_(1, tail, -1), pos, base) for ql, qp, slots, pos, base in sets]
        min_bytes, flops = min_bytes // 2, flops / 2
    if spread:
        g = torch.Generator().manual_seed(batch)
        lens = torch.randint(819, TOPK + 1, (batch,), generator=g).cuda()
        keep = torch.arange(TOPK, device="cuda")[None, :] < lens[:, None]
        sets = [(ql, qp, torch.where(keep, slots, -1), pos, base) for ql, qp, slots, pos, base in sets]
        frac = float(keep.float().mean())
        min_bytes, flops = int(min_bytes * frac), flops * frac
    if contiguous:
        row0 = lambda base: base[:, None] + torch.arange(TOPK, device="cuda")[None, :]  # noqa: E731
        sets = [(q_lat, q_pe, row0(base), pos, base) for q_lat, q_pe, slots, pos, base in sets]
    rows = []
    for name in names:
        if deadline is not None and time.monotonic() > deadline:
            print(f"budget spent: {name} at batch {batch} skipped", flush=True)
            break
        opts = dict(CONFIGS[name])

        def call(q_lat, q_pe, slots, pos, base, opts=opts):
            if opts.get("order"):
                opts = {**opts, "order": False, "rows": row_order(slots)}
            return lambda: attend(q_lat, q_pe, cache, slots, opts, prefill)

        try:
            us = graph_time_us([call(*x) for x in sets], reps=10 if prefill else 30)
        except Exception as e:  # a config that does not fit (shared memory, registers) is reported
            print(f"config {name} fp8={fp8} batch {batch} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        floor_us = max(flops / ceil["bf16"], min_bytes / ceil["copy"]) * 1e6
        rows.append(
            {
                "cache": "fp8" if fp8 else "bf16",
                "heads": heads,
                "batch": (f"causal prefill {batch}" if causal else f"prefill {batch}")
                if prefill
                else (
                    f"{batch} contiguous" if contiguous else f"{batch} half -1" if half
                    else f"{batch} spread 819-2048" if spread else batch
                ),  # fmt: skip
                "config": name,
                "us": us,
                "us_per_token": us / batch,
                "TFLOPs": flops / (us * 1e-6) / 1e12,
                "TBps": min_bytes / (us * 1e-6) / 1e12,
                "floor_us": floor_us,
                "roofline_frac": floor_us / us,
            }
        )
        print(rows[-1], flush=True)
    return rows


def warm(names, batches) -> None:
    """Compile every (config, batch, cache) launch on a small cache: same specialisation as the
    measured launches (the split count follows the batch)."""
    for fp8 in (True, False):
        cache = fmt.alloc_latent(CTX, RANK, ROPE, fp8, torch.bfloat16, "cuda")
        for batch in batches:
            q_lat = torch.randn(batch, 64, RANK, device="cuda", dtype=torch.bfloat16)
            q_pe = torch.randn(batch, 64, ROPE, device="cuda", dtype=torch.bfloat16)
            slots = torch.randint(0, CTX, (batch, TOPK), device="cuda")
            for name in names:
                try:
                    attend(q_lat, q_pe, cache, slots, CONFIGS[name], prefill=batch >= PREFILL_TOKENS)
                except Exception as e:
                    print(f"warm {name} fp8={fp8} batch {batch}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="triton-sparse-mla-v3", help="results file stem after the date")
    ap.add_argument(
        "--configs", default="v2,default,pf-n64s3,pf-n32s3,pf-n64s2-x1,pf-n32s3-x1", help="names from CONFIGS"
    )
    ap.add_argument("--batches", default="64,128,256,1")
    ap.add_argument(
        "--prefill", default="v2,default,pf-n64s2-trim", help="configs run on 2048-token prefills ('' for none)"
    )
    ap.add_argument("--budget", type=float, default=0.0, help="seconds after which no new case starts (0: none)")
    ap.add_argument("--warm", action="store_true", help="only compile the launches (for parallel warm-up)")
    ap.add_argument(
        "--no-controls", action="store_true", help="skip the contiguous-rows and half -1 control cases"
    )
    ap.add_argument(
        "--spread", default="", help="batches of rows of mixed lengths (819-2048), e.g. 64,128,256 ('' for none)"
    )
    ap.add_argument(
        "--spread-configs", default="gluon-trim,gluon-order,gluon-ws-trim,gluon-ws-order", help="configs of --spread"
    )
    args = ap.parse_args()
    names = [n for n in args.configs.split(",") if n]
    batches = [int(b) for b in args.batches.split(",") if b]
    prefill = [n for n in args.prefill.split(",") if n]
    if args.warm:
        warm(names, batches)
        if prefill:
            warm(prefill, [PREFILL_TOKENS])
        return
    deadline = time.monotonic() + args.budget if args.budget else None
    torch.manual_seed(0)
    ceil = {"copy": copy_bandwidth(), "bf16": bf16_matmul_rate()}
    ceilings = {"copy_TBps": ceil["copy"] / 1e12, "bf16_TFLOPs": ceil["bf16"] / 1e12}
    print(f"copy {ceilings['copy_TBps']:.2f} TB/s, bf16 matmul {ceilings['bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
    rows = []
    for batch in batches:
        for fp8 in (True, False):
            if deadline is None or time.monotonic() < deadline:
                rows += measure_all(batch, 64, fp8, names, ceil, deadline=deadline)
    # Control: the same work on physically consecutive rows (how much of the time is the random gather).
    for fp8 in (True, False) if not args.no_controls else ():
        if deadline is None or time.monotonic() < deadline:
            ctl = [n for n in ("v2", "default") if n in names]
            rows += measure_all(64, 64, fp8, ctl, ceil, contiguous=True, deadline=deadline)
    # Decode of short contexts: half of every list is -1.
    for fp8 in (True, False) if not args.no_controls else ():
        if deadline is None or time.monotonic() < deadline:
            half = ["default", "mask", "mask-trim"] + (["gluon", "gluon-trim"] if "gluon" in names else [])
            rows += measure_all(64, 64, fp8, half, ceil, half=True, deadline=deadline)
    # Rows of serving's mixed lengths: the trimmed loops against the step's row order (or work plan).
    for batch in [int(b) for b in args.spread.split(",") if b]:
        for fp8 in (True, False):
            if deadline is None or time.monotonic() < deadline:
                spread_names = [n for n in args.spread_configs.split(",") if n]
                rows += measure_all(batch, 64, fp8, spread_names, ceil, spread=True, deadline=deadline)
    for causal in (False, True):
        for fp8 in (True, False):
            if prefill and (deadline is None or time.monotonic() < deadline):
                rows += measure_all(
                    PREFILL_TOKENS, 64, fp8, prefill, ceil, prefill=True, causal=causal, deadline=deadline
                )
    cols = ["cache", "heads", "batch", "config", "us", "us_per_token", "TFLOPs", "TBps", "floor_us", "roofline_frac"]
    best = {}
    for r in rows:
        key = (r["cache"], r["batch"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    notes = (
        "Fastest per case: "
        + "; ".join(
            f"{c} {b}: {r['config']} {r['us']:.1f} us ({r['TFLOPs']:.0f} TFLOP/s)" for (c, b), r in best.items()
        )
        + ". Target: >= 250 TFLOP/s effective (<= 1.2 us per token) at batch >= 64."
    )
    write_results(args.name, args.out, ceilings, rows, cols, notes)
    print(notes)
    print(f"copy {ceilings['copy_TBps']:.2f} TB/s, bf16 matmul {ceilings['bf16_TFLOPs']:.0f} TFLOP/s")
    print_table(rows, cols)


if __name__ == "__main__":
    main()
