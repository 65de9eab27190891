"""Compile every Triton attention kernel (and the MoE layout kernels, the sampler's pick and threshold) for sm_90
(Hopper) without a GPU: the whole pipeline through ptxas. Triton's CPU interpreter runs code the compiler rejects (a helper returning
different types from two constexpr branches, a constexpr reassigned in an unrolled loop), so
the tests run this in a process of its own, without TRITON_INTERPRET.

    python tests/kernels/compile_sm90.py       (prints one line per kernel, exits 1 on a failure)
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from nsaserve.kernels import gluon_moe_down as gmd
from nsaserve.kernels import gluon_sparse_mla as gm
from nsaserve.kernels import gluon_sparse_mla_ws as gmw
from nsaserve.kernels import triton_indexer as ti
from nsaserve.kernels import triton_kv_store as tkv
from nsaserve.kernels import triton_moe_align as ta
from nsaserve.kernels import triton_moe_w4a16 as tw
from nsaserve.kernels import triton_norm_rope as tnr
from nsaserve.kernels import triton_penalties as tpen
from nsaserve.kernels import triton_row_lse_topk as tlt
from nsaserve.kernels import triton_sample_pick as tsp
from nsaserve.kernels import triton_sample_threshold as tst
from nsaserve.kernels import triton_sparse_mla as tm
from nsaserve.kernels import triton_topk as tk

TARGET = GPUTarget("cuda", 90, 32)
F32 = "*fp32"


def indexer_cases():
    # (fp8 keys, query split mode, rows per program, one lookup per page): every mode and both
    # load paths at least once.
    for fp8, mode, rows, one_page, fold in (
        (True, 2, 1, True, False), (True, 3, 4, True, False), (True, 1, 1, False, False), (False, 1, 4, True, False),
        (False, 0, 1, False, False), (True, 4, 1, True, True), (True, 4, 4, True, True), (True, 4, 8, True, True),
        (True, 2, 4, True, True), (True, 4, 4, True, "direct"), (True, 4, 1, True, "direct"),
        (True, 2, 1, True, "direct"), (True, 2, 4, True, "direct"), (True, 4, 8, True, "direct"),
    ):  # fmt: skip
        direct, fold = fold == "direct", fold is True  # "direct": fp8-typed keys, slots read before the loop
        k_ty = ("*fp8e4nv" if direct else "*u8") if fp8 else ("*bf16" if mode else F32)
        sig = {
            "q_ptr": F32, "w_ptr": F32, "kv_slots_ptr": "*i64", "row_kv_off_ptr": "*i32",
            "row_pos_ptr": "*i32", "blk_row0_ptr": "*i32", "blk_rows_ptr": "*i32", "k_ptr": k_ty,
            "k_scale_ptr": F32 if fp8 else k_ty, "out_ptr": F32, "out_stride": "i32", "heads": "i32",
            "scale": "fp32", "fit": "i32",
        }  # fmt: skip
        consts = dict(
            D=128, PS=64, BLOCK_H=32, BLOCK_N=64, SPAN_BLOCKS=4, ROWS=rows, FP8=fp8, MODE=mode,
            ONE_PAGE=one_page, PRECISION="tf32x3", INTERPRET=False, FOLD=fold, PRELOAD=direct,
        )  # fmt: skip
        name = f"logits fp8={fp8} mode={mode} rows={rows} one_page={one_page} fold={fold} direct={direct}"
        yield name, ti._logits_kernel, sig, consts, 4
    sig = {
        "logits_ptr": F32, "row_pos_ptr": "*i32", "out_ptr": "*i64", "logits_stride": "i32",
        "out_stride": "i32", "topk": "i32", "width": "i32",
    }  # fmt: skip
    for bits, nchunk in ((8, 1), (5, 2)):
        yield (
            f"topk bits={bits} chunks={nchunk}",
            tk._topk_kernel,
            {**sig, "nchunk": "i32"},
            dict(CHUNK=4096, MULTI=nchunk > 1, NCHUNK=0, BITS=bits, INTERPRET=False),
            8,
        )
    names = ("logits_ptr", "row_pos_ptr", "out_ptr", "scratch_ptr", "logits_stride", "out_stride", "topk", "width")
    sig_s = {k: sig.get(k, "*i32") for k in names}  # the sampled kernel adds an int32 scratch row
    consts = dict(CHUNK=4096, SAMPLES=256, MARGIN=16, CAND=1024, BITS=6)
    yield "topk sampled", tk._topk_sampled_kernel, sig_s, consts, 8
    # Compiled, the streamed kernel's loops run to each row's own piece count (NSUB: interpreter only).
    consts = dict(SUB=512, SAMPLES=256, MARGIN=16, CAND=1024, BITS=4, WTILES=4, NSUB=0, INTERPRET=False)
    yield "topk streamed", tk._topk_streamed_kernel, sig_s, consts, 4
    consts = dict(SUB=1024, SAMPLES=256, MARGIN=16, CAND=1024, BITS=4, WTILES=2, NSUB=0, INTERPRET=False)
    yield "topk streamed, one warp a row", tk._topk_streamed_kernel, sig_s, consts, 1
    # A tiny test model's rows (tens of keys).
    consts = dict(CHUNK=32, SAMPLES=32, MARGIN=16, CAND=32, BITS=4)
    yield "topk sampled, 32 keys", tk._topk_sampled_kernel, sig_s, consts, 4


def sparse_mla_cases():
    # The launches the benchmark and the registry use, with the launch's specialisation (16-byte
    # divisible pointers, heads and index row stride; top-k is not specialised): without it
    # Triton pipelines nothing, so neither the shared memory nor the schedule would be the
    # launched kernel's.
    attrs = {(i,): [["tt.divisibility", 16]] for i in (*range(12), 13)}
    for fp8 in (True, False):
        for logical, split, skip, prefetch, trim, mask_all, block_n, stages in (
            (False, True, False, True, False, False, 64, 2),  # decode default
            (True, False, True, True, True, False, 32, 4),  # prefill default
            (False, True, False, False, False, False, 64, 2),  # v2
            (True, True, False, True, True, True, 64, 2),  # trim + mask_all
        ):  # fmt: skip
            cache_ty = "*u8" if fp8 else "*bf16"
            sig = {
                "q_lat_ptr": "*bf16", "q_pe_ptr": "*bf16", "cache_ptr": cache_ty,
                "cache_f32_ptr": F32 if fp8 else cache_ty, "cache_bf16_ptr": "*bf16", "idx_ptr": "*i64",
                "kv_base_ptr": "*i64", "kv_slots_ptr": "*i64", "o_ptr": F32, "lse_ptr": F32, "work_ptr": "*i32", "heads": "i32",
                "topk": "i32", "idx_stride": "i32", "num_splits": "i32", "scale_log2": "fp32", "split_len": "i32",
            }  # fmt: skip
            consts = dict(
                SPLIT_LEN=0, R=512, P=64, P_PAD=64, G=128, ROW_BYTES=656 if fp8 else 576,
                BLOCK_H=64, BLOCK_N=block_n, FP8=fp8, LOGICAL=logical, SPLIT=split, SKIP_EMPTY=skip,
                PREFETCH=prefetch, TRIM=trim, TRIM_LEN=1024 if split else 2048, MASK_ALL=mask_all,
                INTERPRET=False,
            )  # fmt: skip
            name = f"sparse mla fp8={fp8} logical={logical} prefetch={prefetch} trim={trim} n{block_n}s{stages}"
            yield name, tm._sparse_mla_kernel, sig, consts, 8, {"num_stages": stages, "attrs": attrs}
            if not split:  # without splits the kernel writes the model's dtype (the registry backend)
                yield name + " bf16 out", tm._sparse_mla_kernel, {**sig, "o_ptr": "*bf16"}, consts, 8, {"num_stages": stages, "attrs": attrs}
            if not logical and prefetch:  # the step's work plan (mla_work): parts of rows, longest first
                work = {**consts, "WORK": True, "TRIM": False}
                yield name + " work plan", tm._sparse_mla_kernel, sig, work, 8, {"num_stages": stages, "attrs": attrs}
                # the step's row order (mla_rows): rows longest first, loops ending at their counts
                order = {**consts, "ORDER": True, "TRIM": False}
                yield name + " row order", tm._sparse_mla_kernel, sig, order, 8, {"num_stages": stages, "attrs": attrs}
    sig = {"o_part_ptr": F32, "lse_ptr": F32, "out_ptr": F32, "counts_ptr": "*i32", "heads": "i32", "num_splits": "i32"}
    yield "sparse mla combine", tm._combine_kernel, sig, dict(R=512, BLOCK_S=8, INTERPRET=False), 4
    yield "sparse mla combine, bf16 out", tm._combine_kernel, {**sig, "out_ptr": "*bf16"}, dict(R=512, BLOCK_S=8, INTERPRET=False), 4
    counts = dict(R=512, BLOCK_S=16, INTERPRET=False, COUNTS=True)
    yield "sparse mla combine, a work plan's counts", tm._combine_kernel, {**sig, "out_ptr": "*bf16"}, counts, 4


def moe_cases():
    # The routed experts' layout kernel: its loop counts are runtime values (one variant per block size).
    sig = {
        "ids_ptr": "*i64", "sorted_slot_ptr": "*i32", "block_expert_ptr": "*i32", "x_ptr": "*bf16", "xp_ptr": "*bf16",
        "n_slots": "i32", "first_expert": "i32", "num_local": "i32", "max_blocks": "i32", "slot_chunks": "i32",
        "expert_block_chunks": "i32", "block_chunks": "i32",
    }  # fmt: skip
    for block_m in (16, 64):
        consts = dict(
            E_P2=512, BLOCK_M=block_m, CHUNK=256, SLOT_CHUNKS=0, EXPERT_BLOCK_CHUNKS=0, BLOCK_CHUNKS=0,
            HIDDEN=6144, BLOCK_K=256, INTERPRET=False,
        )  # fmt: skip
        yield f"moe align block_m={block_m}", ta._moe_align_kernel, sig, consts, 4
    # 8-token blocks with the larger experts' runs in pairs (decode sizes).
    yield "moe align block_m=8 paired", ta._moe_align_kernel, sig, {**consts, "BLOCK_M": 8, "PAIRED": True}, 4
    # The chunked align for prompt-sized steps (an in-register sort of 1024 keys, an atomic count).
    count_sig = {
        "ids_ptr": "*i64", "chunk_count_ptr": "*i32", "chunk_before_ptr": "*i32", "total_ptr": "*i32", "x_ptr": "*bf16",
        "xp_ptr": "*bf16", "n_slots": "i32", "first_expert": "i32", "num_local": "i32", "n_chunks": "i32",
    }  # fmt: skip
    chunk = dict(E_P2=512, SLOT_CHUNK=ta.ALIGN_SLOT_CHUNK)
    yield "moe align count", ta._moe_align_count_kernel, count_sig, dict(**chunk, HIDDEN=6144, BLOCK_K=256), 4
    runs_sig = {
        "total_ptr": "*i32", "chunk_count_ptr": "*i32", "chunk_before_ptr": "*i32", "chunk_base_ptr": "*i32",
        "sorted_slot_ptr": "*i32", "block_expert_ptr": "*i32", "n_chunks": "i32", "max_blocks": "i32",
        "expert_block_chunks": "i32", "block_chunks": "i32", "chunk_blocks": "i32",
    }  # fmt: skip
    for block_m in (64, 128):
        consts = dict(
            E_P2=512, BLOCK_M=block_m, CHUNK=256, EXPERT_BLOCK_CHUNKS=0, BLOCK_CHUNKS=0, CHUNK_BLOCKS=0, INTERPRET=False
        )
        yield f"moe align runs block_m={block_m}", ta._moe_align_runs_kernel, runs_sig, consts, 4
    yield "moe align runs block_m=8 paired", ta._moe_align_runs_kernel, runs_sig, {**consts, "BLOCK_M": 8, "PAIRED": True}, 4
    place_sig = {
        "ids_ptr": "*i64", "chunk_base_ptr": "*i32", "sorted_slot_ptr": "*i32", "n_slots": "i32",
        "first_expert": "i32", "num_local": "i32",
    }  # fmt: skip
    yield "moe align place", ta._moe_align_place_kernel, place_sig, chunk, 4
    # The expert kernels at GLM-5 shapes, tiled weights, decode-sized blocks (16 tokens).
    gate_up_sig = {
        "x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "s2_ptr": F32, "sorted_slot_ptr": "*i32",
        "block_expert_ptr": "*i32", "h_ptr": "*bf16", "part_ptr": F32, "count_ptr": "*i32", "w_desc": "*i32",
        "s_desc": "*u8", "top_k": "i32", "part_rows": "i32", "first_expert": "i32", "num_local": "i32",
    }  # fmt: skip
    consts = dict(
        K=6144, INTER=2048, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, H_BLOCK_K=256, FUSE_K=True, ASM=True,
        INTERPRET=False, LAYOUT=2, SPLIT_K=1, TMA=False, PDL=True,
    )  # fmt: skip
    yield "moe gate/up tiled, PDL", tw._moe_gate_up_kernel, gate_up_sig, consts, 4, {"num_stages": 3}
    # 8-token blocks (mma.sync), and paired: 8- or 16-token blocks (wgmma) by the block's mark.
    yield "moe gate/up tiled, 8 tokens", tw._moe_gate_up_kernel, gate_up_sig, {**consts, "BLOCK_M": 8}, 4, {"num_stages": 3}
    paired = {**consts, "BLOCK_M": 8, "PAIRED": True, "PDL": False}
    yield "moe gate/up tiled, 8 tokens paired", tw._moe_gate_up_kernel, gate_up_sig, paired, 4, {"num_stages": 3, "maxnreg": 168}
    down_sig = {
        "h_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "s2_ptr": F32, "sorted_slot_ptr": "*i32",
        "block_expert_ptr": "*i32", "topk_w_ptr": F32, "y_ptr": "*bf16", "w_desc": "*i32", "s_desc": "*u8",
    }  # fmt: skip
    consts = dict(
        HIDDEN=6144, INTER=2048, BLOCK_M=16, BLOCK_N=128, BLOCK_K=256, FUSE_K=True, ASM=True, INTERPRET=False,
        LAYOUT=2, TMA=False, PDL=False,
    )  # fmt: skip
    yield "moe down tiled", tw._moe_down_kernel, down_sig, consts, 4, {"num_stages": 3}
    yield "moe down tiled, 8 tokens", tw._moe_down_kernel, down_sig, {**consts, "BLOCK_M": 8}, 4, {"num_stages": 3}
    paired = {**consts, "BLOCK_M": 8, "PAIRED": True}
    yield "moe down tiled, 8 tokens paired", tw._moe_down_kernel, down_sig, paired, 4, {"num_stages": 3}
    masked = {**paired, "MASK_H": True}
    yield "moe down tiled, 8 tokens paired, padding rows of h masked", tw._moe_down_kernel, down_sig, masked, 4, {"num_stages": 3}


def gluon_sparse_mla_sig(fp8: bool, split: bool) -> dict:
    """Both Gluon sparse MLA kernels' signature: an FP8 (uint8) or bf16 cache, float32 parts or
    the model's dtype out."""
    cache_ty = "*u8" if fp8 else "*bf16"
    return {
        "q_lat_ptr": "*bf16", "q_pe_ptr": "*bf16", "cache_ptr": cache_ty, "cache_f32_ptr": F32 if fp8 else cache_ty,
        "cache_bf16_ptr": "*bf16", "idx_ptr": "*i64", "o_ptr": F32 if split else "*bf16", "lse_ptr": F32,
        "work_ptr": "*i32", "heads": "i32", "topk": "i32", "idx_stride": "i32", "num_splits": "i32", "scale_log2": "fp32", "split_len": "i32",
    }  # fmt: skip


def gluon_sparse_mla_cases():
    """The Gluon decode kernel (Hopper only; no CPU interpreter runs it)."""
    for fp8 in (True, False):
        for split, trim in ((True, False), (False, True)):
            sig = gluon_sparse_mla_sig(fp8, split)
            consts = dict(R=512, P=64, G=128, ROW_BYTES=656 if fp8 else 576, BLOCK_N=64, FP8=fp8, SPLIT=split, TRIM=trim, TRIM_LEN=2048, BITS=gm.FP8_DEQUANT_BITS)
            name = f"gluon sparse mla fp8={fp8} split={split} trim={trim}"
            yield name, gm._sparse_mla_gluon_kernel, sig, consts, 8, {"gluon": True}
            if fp8:
                yield name + " stage", gm._sparse_mla_gluon_kernel, sig, {**consts, "STAGE": True}, 8, {"gluon": True}
                # the other FP8 dequantisation (bit operations or float32) than the default
                other = {**consts, "STAGE": True, "BITS": not gm.FP8_DEQUANT_BITS}
                yield name + " stage bits=" + str(other["BITS"]), gm._sparse_mla_gluon_kernel, sig, other, 8, {"gluon": True}
            # Copies issued before QK^T from slots loaded a block ahead (staged rows with FP8).
            early = {**consts, "STAGE": fp8, "EARLY": True}
            yield name + " early", gm._sparse_mla_gluon_kernel, sig, early, 8, {"gluon": True}
            if split:  # the step's work plan (mla_work): parts of rows, longest first
                yield name + " work plan", gm._sparse_mla_gluon_kernel, sig, {**consts, "WORK": True}, 8, {"gluon": True}
            # the step's row order (mla_rows): rows longest first, loops ending at their counts
            order = {**consts, "ORDER": True, "TRIM": False}
            yield name + " row order", gm._sparse_mla_gluon_kernel, sig, order, 8, {"gluon": True}


def gluon_sparse_mla_ws_cases():
    """The warp-specialised Gluon decode kernel (Hopper only). ptxas must keep its asynchronous
    wgmmas (a PV left in flight across the loop's back edge once made it serialise every one of
    them: its C7515 note) and the partitions' register counts (C7507: setmaxnreg ignored)."""
    for fp8 in (True, False):
        for split, trim in ((True, False), (False, True)):
            sig = gluon_sparse_mla_sig(fp8, split)
            consts = dict(R=512, P=64, G=128, ROW_BYTES=656 if fp8 else 576, FP8=fp8, SPLIT=split, TRIM=trim, TRIM_LEN=2048, BITS=gmw.FP8_DEQUANT_BITS, Q_HERE=split)
            opts = {"gluon": True, "ptxas_clean": ("C7515", "C7507")}
            yield f"gluon sparse mla ws fp8={fp8} split={split} trim={trim}", gmw._sparse_mla_ws_kernel, sig, consts, 4, opts
            work = {**consts, "WORK": True, "TRIM": False}
            yield f"gluon sparse mla ws fp8={fp8} split={split} work plan", gmw._sparse_mla_ws_kernel, sig, work, 4, opts
            order = {**consts, "ORDER": True, "TRIM": False}
            yield f"gluon sparse mla ws fp8={fp8} split={split} row order", gmw._sparse_mla_ws_kernel, sig, order, 4, opts


def ptxas_notes(ptx: str) -> str:
    """ptxas's verbose notes on a kernel's PTX for sm_90a (the compiler's own ptxas)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run(
            [get_ptxas(90).path, "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    return run.stderr


def gluon_moe_down_cases():
    """The Gluon MoE down kernel (Hopper only), at its default depth and register cap and at 4 stages."""
    sig = {
        "h_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "s2_ptr": F32, "sorted_slot_ptr": "*i32",
        "block_expert_ptr": "*i32", "topk_w_ptr": F32, "y_ptr": "*bf16", "nblocks": "i32",
    }  # fmt: skip
    for bm, stages in ((16, gmd.STAGES), (32, gmd.STAGES), (16, 4)):
        consts = dict(HIDDEN=6144, INTER=2048, BM=bm, STAGES=stages, FIX=128.0)
        opts = {"gluon": True, "maxnreg": gmd.MAXNREG}
        yield f"gluon moe down bm={bm} stages={stages}", gmd._moe_down_gluon_kernel, sig, consts, 4, opts


def sample_pick_cases():
    for greedy, temp, th, x_ty in (
        (False, False, False, F32), (True, False, False, F32), (True, True, False, "*bf16"), (True, True, True, "*bf16"),
        (False, True, True, F32),
    ):  # fmt: skip
        sig = {"x_ptr": x_ty, "u_ptr": F32, "greedy_ptr": "*u8", "temp_ptr": F32, "th_ptr": F32, "val_ptr": F32,
               "idx_ptr": "*i32", "vocab": "i32", "stride_x": "i32", "stride_u": "i32", "piece": "i32"}  # fmt: skip
        consts = dict(HAS_GREEDY=greedy, HAS_TEMP=temp, HAS_TH=th, U_MAX=tsp._U_MAX, BLOCK=tsp.BLOCK, STEPS=0, INTERPRET=False)
        yield f"sample pick greedy={greedy} temperature={temp} threshold={th} logits {x_ty[1:]}", tsp._sample_pick_kernel, sig, consts, 8


def sample_threshold_cases():
    # The filters' threshold passes at GLM-5's vocabulary (154,880: 18 pieces at most, 32 wide).
    common = dict(PIECES=32, INTERPRET=False)
    filt = {"temp_ptr": F32, "topk_ptr": "*i64", "topp_ptr": F32, "log_minp_ptr": F32}
    row = {"vocab": "i32", "stride_x": "i32", "piece": "i32"}
    for x_ty in ("*bf16", F32):
        x = {"x_ptr": x_ty, **filt}
        sig = {**x, "pmax_ptr": F32, "pmin_ptr": F32, **row}
        yield f"threshold max {x_ty[1:]}", tst._max_kernel, sig, {**common, "STEPS": 0}, 8
        for refine in (False, True):
            sig = {**x, "pmax_ptr": F32, "pmin_ptr": F32, "info_ptr": F32, "count_ptr": "*i32", "mass_ptr": F32, **row}
            consts = {**common, "CAP": tst.CAP, "REFINE": refine, "STEPS": 0}
            yield f"threshold ladder {x_ty[1:]} refine={refine}", tst._ladder_kernel, sig, consts, 8
        sig = {**x, "info_ptr": F32, "base_ptr": "*i32", "scratch_ptr": x_ty, **row}
        yield f"threshold collect {x_ty[1:]}", tst._collect_kernel, sig, {**common, "CAP": tst.CAP, "STEPS": 0}, 8
        sig = {**x, "pmax_ptr": F32, "info_ptr": F32, "scratch_ptr": x_ty, "th_ptr": F32, "vocab": "i32",
               "stride_x": "i32", "pieces": "i32"}  # fmt: skip
        yield f"threshold finish {x_ty[1:]}", tst._finish_kernel, sig, {**common, "CAP": tst.CAP, "STEPS": 0}, 4
    for refine in (False, True):
        sig = {**{k: v for k, v in filt.items() if k != "temp_ptr"}, "pmax_ptr": F32, "pmin_ptr": F32,
               "count_ptr": "*i32", "mass_ptr": F32, "info_ptr": F32, "base_ptr": "*i32", "vocab": "i32",
               "pieces": "i32"}  # fmt: skip
        consts = {"PIECES": 32, "CAP": tst.CAP, "REFINE": refine}
        yield f"threshold bracket refine={refine}", tst._bracket_kernel, sig, consts, 1


def logprobs_and_penalties_cases():
    # The logprobs' lse + top-k (one program per row, and pieces with their merge) and the penalties.
    for x_ty in ("*bf16", F32):
        for split in (False, True):
            sig = {"x_ptr": x_ty, "lse_ptr": F32, "val_ptr": F32, "idx_ptr": "*i32" if split else "*i64",
                   "vocab": "i32", "stride": "i32", "k": "i32", "piece": "i32"}  # fmt: skip
            consts = dict(KP=tlt.CANDIDATES, BLOCK=tlt.BLOCK, STEPS=0, SPLIT=split, INTERPRET=False)
            yield f"row lse + top-k {x_ty[1:]} split={split}", tlt._row_lse_topk_kernel, sig, consts, 8
    sig = {"part_lse_ptr": F32, "part_val_ptr": F32, "part_idx_ptr": "*i32", "lse_ptr": F32, "val_ptr": F32,
           "idx_ptr": "*i64", "k": "i32", "pieces": "i32"}  # fmt: skip
    yield "row lse + top-k merge", tlt._merge_kernel, sig, dict(KP=tlt.CANDIDATES, PIECES=tlt.MAX_PIECES, INTERPRET=False), 4
    for h_ty in ("*i32", "*i64"):
        sig = {"out_ptr": F32, "save_ptr": F32, "hist_ptr": h_ty, "rows_ptr": "*i64", "start_ptr": "*i64",
               "len_ptr": "*i64", "prompt_ptr": "*i64", "pending_ptr": "*i64", "first_ptr": "*i64", "rep_ptr": F32,
               "freq_ptr": F32, "pres_ptr": F32, "vocab": "i32"}  # fmt: skip
        yield f"penalties history {h_ty[1:]}", tpen._penalties_kernel, sig, dict(BLOCK=tpen.BLOCK, STEPS=0, INTERPRET=False), 4


def kv_store_cases():
    # The indexer key's fused norm, rope, rotation and store at GLM-5's 128 dims (64 roped).
    for fp8, rotate, interleaved in ((True, True, False), (True, True, True), (False, False, True), (True, False, False)):
        cache = "*u8" if fp8 else "*bf16"
        sig = {
            "k_ptr": "*bf16", "slots_ptr": "*i64", "cache_ptr": cache, "cache_f32_ptr": F32 if fp8 else cache,
            "k_stride": "i32", "page_size": "i32", "w_ptr": "*bf16", "b_ptr": "*bf16", "cos_ptr": F32,
            "sin_ptr": F32, "cs_stride": "i32", "eps": "fp32", "rot_scale": "fp32",
        }  # fmt: skip
        consts = dict(
            D=128, HALF=32, BLOCK_REST=64, FP8=fp8, ROTATE=rotate, SCALE_FMT=0, INTERLEAVED=interleaved, INTERPRET=False
        )  # fmt: skip
        name = f"index key prep+store fp8={fp8} rotate={rotate} interleaved={interleaved}"
        yield name, tkv._index_k_prep_store_kernel, sig, consts, 4 if rotate else 1
    # The indexer query's RoPE + rotation (32 heads x 128, 64 roped; bf16 and float32 inputs).
    for x_ty, interleaved in (("*bf16", True), ("*bf16", False), (F32, True)):
        sig = {
            "x_ptr": x_ty, "cos_ptr": F32, "sin_ptr": F32, "out_ptr": F32, "heads": "i32", "x_stride_t": "i32",
            "x_stride_h": "i32", "cs_stride": "i32", "rot_scale": "fp32",
        }  # fmt: skip
        consts = dict(D=128, HALF=32, BLOCK_HALF=32, BLOCK_REST=64, BLOCK_H=32, INTERLEAVED=interleaved, INTERPRET=False)
        yield f"rope+rotation x {x_ty[1:]} interleaved={interleaved}", tnr._rope_rotate_kernel, sig, consts, 4


def main() -> int:
    assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET"
    failed = 0
    cases = [
        *indexer_cases(), *sparse_mla_cases(), *gluon_sparse_mla_cases(), *gluon_sparse_mla_ws_cases(), *moe_cases(), *gluon_moe_down_cases(), *sample_pick_cases(),
        *sample_threshold_cases(), *logprobs_and_penalties_cases(), *kv_store_cases(),
    ]  # fmt: skip
    for name, fn, sig, consts, warps, *extra in cases:
        opts = extra[0] if extra else {}
        try:
            # Pointers 16-byte aligned, as the runtime specialises them (this turns on the pipelined
            # async copies the device compiles), unless the case gives its own attributes.
            default_attrs = {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(sig.values()) if ty.startswith("*")}
            stages = opts.get("num_stages", 3 if fn is ti._logits_kernel else 2)
            source = GluonASTSource if opts.get("gluon") else ASTSource
            k = triton.compile(
                source(fn, sig, consts, opts.get("attrs", default_attrs)),
                target=TARGET,
                options={"num_warps": warps, "num_stages": stages, **({"maxnreg": opts["maxnreg"]} if "maxnreg" in opts else {})},
            )
            # An H100/H200 block may use up to 227 KB of shared memory.
            assert k.metadata.shared <= 227 * 1024, f"{k.metadata.shared} bytes of shared memory"
            if opts.get("ptxas_clean"):
                notes = ptxas_notes(k.asm["ptx"])
                bad = [line for line in notes.splitlines() if any(code in line for code in opts["ptxas_clean"])]
                assert not bad, "; ".join(bad)
            print("ok  ", name, f"(shared {k.metadata.shared} B)", flush=True)
        except Exception as e:  # report every kernel, not just the first failure
            failed += 1
            print("FAIL", name, f"{type(e).__name__}: {str(e)[:2000]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
