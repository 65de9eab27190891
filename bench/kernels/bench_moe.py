"""Triton NVFP4 W4A16 MoE (routed experts of one layer) at GLM-5 shapes on one GPU.

    PYTHONPATH=pyworker python bench/kernels/bench_moe.py [--out bench/results] [--batches 1,64,256,1024]
        [--sweep 1,256] [--align 256,512,1024,2048,16384] [--partial PATH]

Hidden 6144, 256 experts (all on this GPU), top-8, intermediate 2048, random NVFP4 weights and
uniform random routing. Times are CUDA-graph replays of moe_experts_nvfp4_triton (align, gate/up +
SiLU·mul, down · routing weight, sum over k), rotating over several routings. The byte floor is what
the layer must read: every expert that received a token, 21.23 MB each (codes, block scales,
globals), plus the activations and the output, over the copy bandwidth measured in the same run
(bytes read + written by a 2 GiB copy). torch_us is the model's torch path (dequantise the
experts with tokens, then per-expert bf16 matmuls) called eagerly. --sweep also times other block
configurations at the listed batches; --align times the layout step alone, the one-launch align
against the chunked one.
Targets: batch 1 <= 50 us, batch 64 <= 1.4 ms, batch 256 <= 1.6 ms, >= 80% of copy bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import types

import torch
from bench_common import bf16_matmul_rate, copy_bandwidth, graph_time_us, machine, print_table, write_results

from nsaserve.kernels import triton_moe_align as ta
from nsaserve.kernels import triton_moe_w4a16 as tm
from nsaserve.kernels.moe import moe_experts_torch
from nsaserve.kernels.quant.nvfp4 import random_nvfp4_experts
from nsaserve.model.expert_stack import ExpertStack
from nsaserve.model.mlp import MoE

HIDDEN, INTER, EXPERTS, TOP_K = 6144, 2048, 256, 8
TARGET_US = {1: 50.0, 64: 1400.0, 256: 1600.0}
ROUTINGS = 4  # routings per timed graph (different experts: weights do not stay in L2 at batch 1)


def expert_bytes() -> int:
    w13 = 2 * INTER * (HIDDEN // 2 + HIDDEN // 16) + 2 * 4
    w2 = HIDDEN * (INTER // 2 + INTER // 16) + 4
    return w13 + w2


def make_stacks(gen):
    w13 = random_nvfp4_experts(EXPERTS, 2 * INTER, HIDDEN, 2, gen, "cuda")
    w2 = random_nvfp4_experts(EXPERTS, HIDDEN, INTER, 1, gen, "cuda")
    return w13, w2


def routing(batch: int, gen):
    ids = torch.rand(batch, EXPERTS, generator=gen, device="cuda").topk(TOP_K, dim=-1).indices
    weights = torch.rand(batch, TOP_K, generator=gen, device="cuda") + 0.1
    return ids, weights


def torch_path_us(x, ids, weights, w13, w2) -> float:
    """The model's torch path (MoE._routed: dequantise the experts with tokens in bounded groups,
    then moe_experts_torch), on ExpertStacks holding the same tensors."""
    stacks = []
    for parts, (rows, cols), q in (
        (("gate_proj", "up_proj"), (INTER, HIDDEN), w13),
        (("down_proj",), (HIDDEN, INTER), w2),
    ):
        s = ExpertStack("nvfp4", parts, rows, cols, EXPERTS, dtype=torch.bfloat16, device="cuda")
        s.weight.data, s.weight_scale.data, s.weight_scale_2.data = q.weight, q.weight_scale, q.weight_scale_2
        stacks.append(s)
    moe = types.SimpleNamespace(w13=stacks[0], w2=stacks[1], first_expert=0, num_local=EXPERTS)
    call = lambda: MoE._routed(moe, x, ids, weights, moe_experts_torch)  # noqa: E731
    call()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(3):
        call()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / 3 * 1e3


# Profiler names -> breakdown column; the chunked align's three kernels add up into align_us.
KERNELS = {
    "_moe_align_kernel": "align_us",
    "_moe_align_count_kernel": "align_us",
    "_moe_align_runs_kernel": "align_us",
    "_moe_align_place_kernel": "align_us",
    "_moe_gate_up_kernel": "gate_up_us",
    "_moe_down_kernel": "down_us",
    "_moe_down_gluon_kernel": "down_us",
    "_moe_sum_kernel": "sum_us",
}


def kernel_breakdown(call, reps: int = 5) -> dict:
    """Device microseconds per call of each of the four kernels (torch profiler, eager calls)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                call()
            torch.cuda.synchronize()
        out = {}
        for evt in prof.key_averages():
            for k, col in KERNELS.items():
                if k in evt.key:  # no name is part of another
                    total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
                    out[col] = out.get(col, 0.0) + total / reps
        return out
    except Exception as e:  # the breakdown is extra information; never fail the benchmark over it
        return {"breakdown_error": f"{type(e).__name__}: {str(e)[:120]}"}


# From this batch on a sweep tries the prompt-sized blocks (64 and more rows per expert).
PREFILL_BATCH = 2048


def configs(batch: int, sweep: bool):
    """(name, config, block_m, asm, layout): the checkpoint layout (False), the re-laid-out weights
    (True: relayout_nvfp4) and those in tiles ("tiled": tile_nvfp4, the model's default) with the
    default blocks, or the alternatives a sweep tries in tiles (TMA loads and pipeline depths at
    decode sizes, token blocks and warps at prompt sizes)."""
    if not sweep:
        yield "checkpoint layout", {}, None, True, False
        yield "relayout", {}, None, True, True
        yield "relayout tiled (default)", {}, None, True, "tiled"
        return
    yield "relayout tiled again", {}, None, True, "tiled"
    if batch >= PREFILL_BATCH:
        # Prompt-sized batches (>= 64 rows per expert): larger token blocks and 8 warps (the 64-row
        # preset with 256-row down tiles is the model's since 2026-12-02; 128-row blocks were from
        # 512 rows per expert before). At 128 token rows two stages fit the 227 KB of shared
        # memory, and 4 warps spill (ptxas: 255 registers and a 384-byte stack for the down
        # kernel), so 8.
        w8s2 = {"num_warps": 8, "num_stages": 2}
        yield "tiled block_m 128 gate_up 64 down 128 w8 s2", {"gate_up": w8s2, "down": w8s2}, 128, True, "tiled"
        c = {"gate_up": {**w8s2, "BLOCK_N": 128}, "down": w8s2}
        yield "tiled block_m 128 gate_up 128 down 128 w8 s2", c, 128, True, "tiled"
        c = {"gate_up": {**w8s2, "BLOCK_N": 128}, "down": {**w8s2, "BLOCK_N": 256}}
        yield "tiled block_m 128 gate_up 128 down 256 w8 s2", c, 128, True, "tiled"
        c = {"gate_up": {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3}, "down": {"num_warps": 8}}
        yield "tiled block_m 64 gate_up 128 w8 s3, down w8", c, 64, True, "tiled"
        c = {"gate_up": {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3}, "down": {"num_warps": 8, "BLOCK_N": 256}}
        yield "tiled block_m 64 gate_up 128 w8 s3, down 256 rows w8", c, 64, True, "tiled"
        # The paired 32-token preset (32 to 64 rows per expert) one size up: where it stops paying.
        yield "tiled block_m 32 paired, the preset's tiles", tm.PROMPT_PRESETS[-1][2], (32, True), True, "tiled"
        # Not here: gluon_moe_down at prompt sizes (each K block dequantised and multiplied a
        # quarter at a time, each MMA overlapping the next quarter's dequantisation). With 64- and
        # 128-row blocks, one or two warpgroups, its down GEMM took 0.95-1.32x the Triton kernel's
        # time and the whole path was 1.6-11% slower on an H100
        # (bench/results/2026-12-05-gluon-moe-down-prompt-h100.md).
        return
    if batch >= 512:
        # Between decode and prompt sizes (16-64 rows per expert; 1024 concurrent decode steps sit at
        # 32): 32-row blocks leave about half the experts with two blocks, each dequantising the
        # expert's weights; 64-row blocks read each expert once (the 64-row preset, the default
        # from 32 rows per expert from 2026-12-02; since 2026-12-05 from 64, with 32-token blocks
        # paired into 64 from 32 rows per expert). Around that preset: pipeline depth, tile
        # widths and warps. (Gate/up at 4 stages needs 236 KB of shared memory, past the 227 KB.)
        preset = tm.PROMPT_PRESETS[-1][2]
        yield "tiled block_m 64, the preset (the default from 32 rows per expert until 2026-12-05)", preset, 64, True, "tiled"
        yield "tiled block_m 32, default blocks (the default below 32 rows per expert)", {}, 32, True, "tiled"
        yield "tiled block_m 64, default blocks", {}, 64, True, "tiled"
        c = {"gate_up": {"num_warps": 8}, "down": {"num_warps": 8}}
        yield "tiled block_m 32 w8", c, 32, True, "tiled"
        # 32-token blocks with the experts of more than 32 rows paired into 64-token blocks (as
        # 8 / 16 at decode sizes): an expert's weights are still dequantised once, and the MMAs of
        # experts with at most 32 rows (about half of them at 32 rows an expert) cover 32 rows, not 64.
        yield "tiled block_m 32 paired, the preset's tiles", preset, (32, True), True, "tiled"
        yield "tiled block_m 32 paired, default tiles", {}, (32, True), True, "tiled"
        tries = (
            ("gate_up s2", {"num_stages": 2}, {}),
            ("down s2", {}, {"num_stages": 2}),
            ("down s4", {}, {"num_stages": 4}),
            ("down 128 rows (the preset before 2026-12-02)", {}, {"BLOCK_N": 128}),
            ("down 64 rows w4", {}, {"BLOCK_N": 64, "num_warps": 4}),
            ("gate_up 64 rows w4", {"BLOCK_N": 64, "num_warps": 4}, {}),
        )
        for name, gate_up, down in tries:
            c = {"gate_up": {**preset["gate_up"], **gate_up}, "down": {**preset["down"], **down}}
            yield f"tiled block_m 64 preset, {name}", c, 64, True, "tiled"
        return
    # Decode-sized steps in tiles. ncu at 256 tokens: gate/up issues on 64% of cycles with 2 programs
    # (8 warps) per multiprocessor, held there by registers (169 a thread); the down kernel's 212
    # registers do the same. The first runs (2026-12-02) made gate/up maxnreg 168 the default for
    # 16-token blocks and PDL the default up to 8 tokens; TMA loads (2-5 stages, with and without
    # caps) and persistent kernels were never faster (bench/results/2026-12-02-triton-moe-occupancy,
    # -persistent). The down kernel reads its weights at ~3.1 TB/s where gate/up reaches ~3.5, so
    # these tries are about it: register caps without TMA, 8 warps (the 128 x 256 dequantised
    # operand is 128 registers a thread with 4), 64- and 256-row tiles, depth.
    # (name, gate/up config, down config)
    tries = (
        ("gate_up without register cap (the default before)", {"maxnreg": None}, {}),
        ("down maxnreg 168", {}, {"maxnreg": 168}),
        ("down maxnreg 128", {}, {"maxnreg": 128}),
        ("down s4", {}, {"num_stages": 4}),
        ("down s4 maxnreg 168", {}, {"num_stages": 4, "maxnreg": 168}),
        ("down 256 rows w8", {}, {"BLOCK_N": 256, "num_warps": 8}),
        ("down 256 rows w8 maxnreg 168", {}, {"BLOCK_N": 256, "num_warps": 8, "maxnreg": 168}),
        ("down w8", {}, {"num_warps": 8}),
        ("down 64 rows", {}, {"BLOCK_N": 64}),
        # Paired blocks put the 16-token wgmma path in the same kernel: 228 registers a thread with
        # 128-row tiles (2 programs a multiprocessor), 128 with 64-row tiles (4), ptxas sm_90.
        ("down 64 rows s4", {}, {"BLOCK_N": 64, "num_stages": 4}),
        ("down 64 rows w2", {}, {"BLOCK_N": 64, "num_warps": 2}),
        ("down mask h (padding rows of h not read)", {}, {"MASK_H": True}),
        ("gate_up 128 rows w8", {"BLOCK_N": 128, "num_warps": 8, "maxnreg": None}, {}),
        ("gate_up s4", {"num_stages": 4}, {}),
    )  # fmt: skip
    for name, gate_up, down in tries:
        yield f"tiled {name}", {"gate_up": gate_up, "down": down}, None, True, "tiled"
    # gluon_moe_down (16-token blocks): one persistent pipeline across tiles, the operand a quarter
    # block at a time; against the Triton kernel on the same blocks.
    yield "tiled block_m 16, Triton down", {}, (16, False), True, "tiled"
    for stages, programs, cap in ((2, 3, 168), (4, 2, None)):
        down = {"GLUON": True, "STAGES": stages, "PROGRAMS_PER_SM": programs, "maxnreg": cap}
        name = f"tiled block_m 16, down gluon {stages} stages x {programs} programs" + (f" cap {cap}" if cap else "")
        yield name, {"down": down}, (16, False), True, "tiled"
    # Token blocks (pick_block_m, paired_blocks): 16 rows (wgmma m64n16k16, the default until
    # 2026-12-04), 8 rows (mma.sync m16n8k16) with and without the larger experts paired into
    # 16-row blocks. (A second launch for the pairs measured the same as one launch, and was removed.)
    yield "tiled block_m 16 (the default before 2026-12-04)", {}, 16, True, "tiled"
    yield "tiled block_m 8 unpaired", {}, (8, False), True, "tiled"
    yield "tiled block_m 8 paired", {}, (8, True), True, "tiled"


def run_batch(batch, stacks, gen, copy_bps, sweep, with_torch, rows, save, only=()):
    """Appends one row per configuration to `rows`, calling save() after each. only: sweep variants
    whose names contain one of these (and the default, timed again), or all."""
    sets = []
    for _ in range(ROUTINGS):
        ids, weights = routing(batch, gen)
        sets.append((torch.randn(batch, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16), ids, weights))
    experts = sum(torch.unique(ids).numel() for _, ids, _ in sets) / ROUTINGS
    nbytes = experts * expert_bytes() + batch * HIDDEN * (2 + 4) + batch * TOP_K * 12
    floor_us = nbytes / copy_bps * 1e6
    first = len(rows)
    for name, config, block_m, asm, relayout in configs(batch, sweep):
        if sweep and only and name != "relayout tiled again" and not any(o in name for o in only):
            continue
        # An empty config without a block size is the model's own choice (prompt_preset included).
        config = None if not config and block_m is None else config
        block_m, paired = block_m if isinstance(block_m, tuple) else (block_m, None)  # rows, or (rows, paired)
        run = functools.partial(tm.moe_experts_nvfp4_triton, block_m=block_m, config=config, asm=asm,
                                relayout=bool(relayout), tiled=relayout == "tiled", paired=paired)  # fmt: skip
        k13, k2 = stacks[relayout]
        calls = [functools.partial(run, x, ids, w, *k13, *k2, 0) for x, ids, w in sets]
        try:
            us = graph_time_us(calls)
        except Exception as e:  # a configuration that does not compile or fit is recorded, not fatal
            rows.append({"batch": batch, "variant": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(rows[-1], flush=True)
            save()
            continue
        # The blocks the call ran: as moe_experts_nvfp4_triton picks them where the variant does not.
        ran_m = block_m or (tm.prompt_preset(batch * TOP_K, EXPERTS) or (tm.pick_block_m(batch * TOP_K, EXPERTS),))[0]
        rows.append({
            "batch": batch, "variant": name, "block_m": ran_m,
            "paired": paired if paired is not None else tm.paired_blocks(ran_m, batch * TOP_K, EXPERTS),
            "experts": experts, "MB": nbytes / 1e6, "us": us, "TBps": nbytes / us / 1e6,
            "copy_frac": floor_us / us, "target_us": TARGET_US.get(batch),
        })  # fmt: skip
        # Where the time goes, and each GEMM's own bandwidth on its weight bytes (and in prompt-sized
        # sweeps, whose variants change one GEMM's kernel, each variant's split).
        if not sweep or batch >= PREFILL_BATCH:
            r = rows[-1]
            r.update(kernel_breakdown(calls[0]))
            w13_bytes, w2_bytes = experts * expert_bytes() * 2 / 3, experts * expert_bytes() / 3
            if r.get("gate_up_us"):
                r["gate_up_TBps"] = w13_bytes / r["gate_up_us"] / 1e6
            if r.get("down_us"):
                r["down_TBps"] = w2_bytes / r["down_us"] / 1e6
        print(rows[-1], flush=True)
        save()
    if with_torch:
        t = torch_path_us(*sets[0], *stacks[False])
        for r in rows[first:]:
            if "us" in r:
                r["torch_us"], r["speedup"] = t, t / r["us"]
        save()


def run_align(batches, gen, rows, save):
    """The layout step alone at each batch: the one-launch align (O(experts x slots)) against the
    chunked one (O(slots + experts x chunks)); ta.ALIGN_CHUNKED_FROM picks between them."""
    for batch in batches:
        sets = []
        for _ in range(ROUTINGS):
            ids, _ = routing(batch, gen)
            sets.append((torch.randn(batch, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16), ids))
        preset = tm.prompt_preset(batch * TOP_K, EXPERTS)
        block_m = preset[0] if preset else tm.pick_block_m(batch * TOP_K, EXPERTS)
        nblocks = tm.max_blocks(batch * TOP_K, EXPERTS, block_m)
        for name, chunked in (("align one launch", False), ("align chunked", True)):
            calls = [
                functools.partial(ta._align, x, ids, 0, EXPERTS, block_m, nblocks, 256, chunked) for x, ids in sets
            ]
            try:
                us = graph_time_us(calls)
            except Exception as e:
                rows.append({"batch": batch, "variant": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            else:
                rows.append({"batch": batch, "variant": name, "block_m": block_m, "align_us": us,
                             "default": chunked == (batch * TOP_K >= ta.ALIGN_CHUNKED_FROM)})  # fmt: skip
            print(rows[-1], flush=True)
            save()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--batches", default="1,64,256,1024")
    ap.add_argument("--sweep", default="", help="batches that also time other block configurations")
    ap.add_argument("--torch-batches", default="1,64,256", help="batches that also time the torch path")
    ap.add_argument("--align", default="", help="batches that time the align step alone, both ways")
    ap.add_argument("--variants", default="", help="comma-separated name parts: a sweep times only those variants")
    ap.add_argument(
        "--partial", default=None, help="JSON file rewritten after each batch (kept if the run is cut short)"
    )
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    ceilings = {"copy_TBps": copy_bandwidth() / 1e12, "bf16_TFLOPs": bf16_matmul_rate() / 1e12}
    print(ceilings, flush=True)
    w13, w2 = make_stacks(gen)
    relaid = [(*tm.relayout_nvfp4(q.weight, q.weight_scale), q.weight_scale_2) for q in (w13, w2)]
    tiled = tuple((*tm.tile_nvfp4(w, s), s2) for w, s, s2 in relaid)
    stacks = {False: (w13, w2), True: tuple(relaid), "tiled": tiled}
    torch_batches = {int(b) for b in args.torch_batches.split(",") if b}
    sweep_batches = {int(b) for b in args.sweep.split(",") if b}
    rows = []

    def save():  # keep what finished if the run is cut short
        if args.partial:
            with open(args.partial, "w") as f:
                json.dump(
                    {"machine": machine(), "command": " ".join(sys.argv), "ceilings": ceilings, "rows": rows},
                    f,
                    indent=1,
                )

    # Every batch with the default configuration first, then the sweeps (cut first when time runs out).
    cases = [(int(b), False) for b in args.batches.split(",") if b] + [(b, True) for b in sorted(sweep_batches)]
    only = tuple(v for v in args.variants.split(",") if v)
    for batch, sweep in cases:
        with_torch = batch in torch_batches and not sweep
        run_batch(batch, stacks, gen, ceilings["copy_TBps"] * 1e12, sweep, with_torch, rows, save, only)
    run_align([int(b) for b in args.align.split(",") if b], gen, rows, save)
    cols = [
        "batch",
        "variant",
        "block_m",
        "paired",
        "experts",
        "MB",
        "us",
        "TBps",
        "copy_frac",
        "target_us",
        "torch_us",
        "speedup",
        "align_us",
        "gate_up_us",
        "gate_up_TBps",
        "down_us",
        "down_TBps",
        "sum_us",
    ]
    notes = (
        "us: CUDA-graph replay of the whole routed-expert path (align, gate/up, down, sum); MB: expert "
        "bytes that must be read (21.23 MB per expert with tokens) + activations; copy_frac: that "
        "floor at the measured copy bandwidth over us; torch_us: the model's torch path, eager; "
        "*_us per kernel: device time of eager calls (profiler), *_TBps: that kernel's weight bytes over it."
    )
    write_results("triton-moe", args.out, ceilings, rows, cols, notes)
    print(f"copy {ceilings['copy_TBps']:.2f} TB/s, bf16 matmul {ceilings['bf16_TFLOPs']:.0f} TFLOP/s")
    if any("us" in r for r in rows):
        print_table([r for r in rows if "us" in r], cols)
    if any(r["variant"].startswith("align ") and "align_us" in r for r in rows):
        print_table([r for r in rows if r["variant"].startswith("align ") and "align_us" in r],
                    ["batch", "variant", "block_m", "align_us", "default"])  # fmt: skip


if __name__ == "__main__":
    main()
