"""Triton NVFP4 mixture of experts as W4A16: 4-bit weights dequantised in registers, bf16 tensor-core
math, float32 accumulation. For Hopper, which has no FP4 tensor cores.

Same function as moe.moe_experts_torch on the dequantised weights (nvfp4.dequantize_nvfp4), read
straight from the checkpoint layout of model/expert_stack.py (no repacking):

    w13 uint8 [E, 2I, H/2] (gate rows, then up rows), e4m3 scales [E, 2I, H/16], fp32 globals [E, 2]
    w2  uint8 [E, H, I/2],                             e4m3 scales [E, H, I/16],  fp32 globals [E, 1]

Four launches (six and a memset with the chunked align), no host synchronisation, every buffer sized by the
worst case for the token count (so a CUDA graph captured for T tokens replays for any routing):

1. The align (triton_moe_align): the (token, k) slots sorted by local expert into BLOCK_M blocks
   (the sorted slot list, -1 = padding, and the expert of each block, -1 = unused), and the
   activations permuted (below); one launch, or three in chunks of slots for prompt-sized steps.
2. _moe_gate_up_kernel, grid (I / BLOCK_N, blocks): for one expert block and BLOCK_N columns of gate
   and of up, C^T = W · X^T with the dequantised weight tile as the MMA's A operand (weights on the
   M side: a handful of tokens only pad the N side to 8 or 16), then h = silu(a_g·gate) · (a_u·up) in
   bf16, per sorted row.
3. _moe_down_kernel, grid (H / BLOCK_N, blocks): y = (a_2·W2 · h^T)^T · routing weight, bf16, one
   row per (token, k) slot.
4. _moe_sum_kernel: out[t] = sum over k of y[t, k] in float32, in a fixed order (deterministic; slots
   whose expert lives on another rank count as 0), plus the optional add[t] (the shared experts).

Packed bytes hold element 2j in the low nibble and 2j+1 in the high one; the kernels read them as
32-bit words (word j of a row = inputs 8j..8j+7) and dequantise one byte position of every word at
a time: byte b gives inputs 8j + 2b and 8j + 2b + 1 of all words as two [BLOCK_N, BLOCK_K/8] tiles,
each multiplied into the accumulator by its own MMA. Instead of interleaving them in registers, the
activations are permuted once per K block (input 8j + r to position r·BLOCK_K/8 + j) so that each
of the 8 partial dots reads a contiguous slice. The gate/up kernel writes h in the permutation the
down kernel reads. The dequantisation itself (inline assembly on the GPU, ordinary arithmetic in
Triton's CPU interpreter) is triton_moe_dequant's.

relayout=True (weights from relayout_nvfp4, done once at load time; the checkpoint format is not
changed and unrelayout_nvfp4 inverts it): the codes in an order that dequantises with fewer
instructions, and re-encoded scales (triton_moe_dequant). Same operand values, same MMAs.
Measured 3-6% faster for the whole path at 1-1024 tokens (bench/results/2026-11-29-triton-moe-v3);
the model's backend (moe_experts_triton) re-lays out its stacks once (STACK_LAYOUT).

tiled=True (with relayout=True; weights from tile_nvfp4 after relayout_nvfp4): the same words and
scales stored in tiles of 16 rows x 256 inputs, so that each 16 rows of a K block are one
contiguous 2 KB read (plus 256 bytes of scales) rather than 16 reads of 128 bytes a row apart
(3 KB apart for gate/up at GLM-5 shapes). Same operands, same MMAs, so the same results bit for
bit; measured on the H200 (bench/results/2026-12-01-triton-moe-tiled): the whole routed-expert
path 8-15% faster than re-laid-out rows at batch 1-1024 (72.4 against 84.8 us at batch 1, 1853
against 2023 us at 256), so it is the model's default (STACK_LAYOUT).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .quant.nvfp4 import (  # noqa: F401
    RELAYOUT_R_MAG,
    RELAYOUT_R_SIGN,
    TILE_K,
    TILE_ROWS,
    relayout_nvfp4,
    tile_nvfp4,
    unrelayout_nvfp4,
    untile_nvfp4,
)
from .quant.precision import NVFP4
from .triton_common import mma_operand
from .triton_moe_align import _align
from .triton_moe_dequant import (
    _ASM_SHIFT,
    _dequant_block,
    _dequant_block_v3,
    _dequant_byte,
    _load_tile,
    _load_tile_tma,
    _load_tile_v3,
)
from .triton_rounding import cast

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dependent_launch(PDL: tl.constexpr):
    """PDL: this kernel was launched as a programmatic dependent of the one before it (launch_pdl),
    so its programs may start while that one still runs: let the next kernel's launch begin too,
    then wait until everything before has finished and its writes are visible. What this saves is
    the launch gap between the MoE's kernels (a few microseconds of a 70-microsecond batch-1 layer)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _block_slots(sorted_slot_ptr, pid_m, BLOCK_M: tl.constexpr, PAIRED: tl.constexpr = False):
    """Sorted rows of expert block pid_m, their (token, k) slots, and which are real (not padding).
    PAIRED: pid_m counts the align's blocks of BLOCK_M / 2 rows, and the block is two of them."""
    STEP: tl.constexpr = BLOCK_M // 2 if PAIRED else BLOCK_M
    offs_m = pid_m * STEP + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_slot_ptr + offs_m)
    return offs_m, slot, slot >= 0


# part_rows follows the step's block count (with 8-token blocks not always a multiple of 16): a
# runtime value, not specialised, or it splits the kernel into two variants by the count's parity.
@triton.jit(do_not_specialize=["top_k", "part_rows", "first_expert", "num_local"])
def _moe_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, s2_ptr, sorted_slot_ptr, block_expert_ptr, h_ptr, part_ptr, count_ptr,
    w_desc, s_desc, top_k, part_rows, first_expert, num_local,
    K: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, H_BLOCK_K: tl.constexpr, FUSE_K: tl.constexpr, ASM: tl.constexpr,
    INTERPRET: tl.constexpr, LAYOUT: tl.constexpr = 0, SPLIT_K: tl.constexpr = 1, TMA: tl.constexpr = False,
    PDL: tl.constexpr = False, PAIRED: tl.constexpr = False,
):  # fmt: skip
    """Grid (I / BLOCK_N, blocks, SPLIT_K): one tile per program (_gate_up_tile). PAIRED: the blocks
    of a paired align (_expert_run): BLOCK_M rows where it marked e, 2 BLOCK_M rows (two of its
    blocks) where it marked -(e + 2); -1 marks an unused block or a pair's second half."""
    _dependent_launch(PDL)
    e = tl.load(block_expert_ptr + tl.program_id(1))
    if e >= 0:
        _gate_up_tile(
            x_ptr, w_ptr, s_ptr, s2_ptr, sorted_slot_ptr, e, h_ptr, part_ptr, count_ptr, w_desc, s_desc, top_k,
            part_rows, tl.program_id(0), tl.program_id(1), tl.program_id(2),
            K, INTER, BLOCK_M, BLOCK_N, BLOCK_K, H_BLOCK_K, FUSE_K, ASM, INTERPRET, LAYOUT, SPLIT_K, TMA, False,
        )  # fmt: skip
    elif PAIRED and e <= -2:
        _gate_up_tile(
            x_ptr, w_ptr, s_ptr, s2_ptr, sorted_slot_ptr, -e - 2, h_ptr, part_ptr, count_ptr, w_desc, s_desc,
            top_k, part_rows, tl.program_id(0), tl.program_id(1), tl.program_id(2),
            K, INTER, 2 * BLOCK_M, BLOCK_N, BLOCK_K, H_BLOCK_K, FUSE_K, ASM, INTERPRET, LAYOUT, SPLIT_K, TMA, True,
        )  # fmt: skip


@triton.jit
def _gate_up_tile(
    x_ptr, w_ptr, s_ptr, s2_ptr, sorted_slot_ptr, e, h_ptr, part_ptr, count_ptr, w_desc, s_desc, top_k, part_rows,
    pid_n, pid_m, pid_k,
    K: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, H_BLOCK_K: tl.constexpr, FUSE_K: tl.constexpr, ASM: tl.constexpr,
    INTERPRET: tl.constexpr, LAYOUT: tl.constexpr, SPLIT_K: tl.constexpr, TMA: tl.constexpr,
    PAIRED: tl.constexpr = False,
):  # fmt: skip
    """Tile (pid_n, pid_m) of used block pid_m (local expert e): h for BLOCK_N columns of gate and of
    up. TMA (tiled weights only): the weight tiles come through w_desc / s_desc (tile_descriptors)
    instead of w_ptr / s_ptr.
    SPLIT_K > 1 (pid_k: grid axis 2): each program sums K / SPLIT_K of the inputs, stores its float32
    partial sums of the block's real rows (part_ptr [SPLIT_K, part_rows, 2, INTER]) and counts
    itself in count_ptr (zeroed per call); the last of a tile's programs adds the partials in split
    order (deterministic) and writes h. More programs for a handful of tokens."""
    W: tl.constexpr = BLOCK_K // 8  # code words per row of a K block; MMA K of each partial dot
    offs_m, slot, valid = _block_slots(sorted_slot_ptr, pid_m, BLOCK_M, PAIRED)
    tok = tl.where(valid, slot // top_k, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_g = e.to(tl.int64) * (2 * INTER) + offs_n
    rows_u = rows_g + INTER
    offs_w = tl.arange(0, W)
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    ITERS: tl.constexpr = K // BLOCK_K // SPLIT_K
    if SPLIT_K > 1:
        k0 = pid_k * ITERS
    else:
        k0: tl.constexpr = 0
    for it in range(ITERS):
        i = k0 + it
        # x is permuted per K block so that input 8j + r sits at r * W + j (see _permute_row).
        xp = x_ptr + tok[None, :] * K + i * BLOCK_K
        if LAYOUT >= 1:  # 2: tiled
            if TMA:
                group_g = (e * (2 * INTER) + pid_n * BLOCK_N) // 16
                wg, sg = _load_tile_tma(w_desc, s_desc, group_g, i, BLOCK_N, ASM)
                wu, su = _load_tile_tma(w_desc, s_desc, group_g + INTER // 16, i, BLOCK_N, ASM)
            else:
                wg, sg = _load_tile_v3(w_ptr, s_ptr, rows_g, i, K // 8, K // 16, BLOCK_N, BLOCK_K, ASM, LAYOUT == 2)
                wu, su = _load_tile_v3(w_ptr, s_ptr, rows_u, i, K // 8, K // 16, BLOCK_N, BLOCK_K, ASM, LAYOUT == 2)
            xt = mma_operand(tl.load(xp + offs_k[:, None], mask=valid[None, :], other=0.0), INTERPRET)
            acc_g = tl.dot(_dequant_block_v3(wg, sg, ASM, INTERPRET), xt, acc_g)
            acc_u = tl.dot(_dequant_block_v3(wu, su, ASM, INTERPRET), xt, acc_u)
        elif FUSE_K:
            wg, sg = _load_tile(w_ptr, s_ptr, rows_g, i, K // 8, K // 16, BLOCK_N, BLOCK_K, ASM)
            wu, su = _load_tile(w_ptr, s_ptr, rows_u, i, K // 8, K // 16, BLOCK_N, BLOCK_K, ASM)
            xt = mma_operand(tl.load(xp + offs_k[:, None], mask=valid[None, :], other=0.0), INTERPRET)
            acc_g = tl.dot(_dequant_block(wg, sg, ASM, INTERPRET), xt, acc_g)
            acc_u = tl.dot(_dequant_block(wu, su, ASM, INTERPRET), xt, acc_u)
        else:
            wg, sg = _load_tile(w_ptr, s_ptr, rows_g, i, K // 8, K // 16, BLOCK_N, BLOCK_K, ASM)
            wu, su = _load_tile(w_ptr, s_ptr, rows_u, i, K // 8, K // 16, BLOCK_N, BLOCK_K, ASM)
            for byte in tl.static_range(4):
                xb = xp + 2 * byte * W + offs_w[:, None]
                x_lo = mma_operand(tl.load(xb, mask=valid[None, :], other=0.0), INTERPRET)  # [W, BLOCK_M]
                x_hi = mma_operand(tl.load(xb + W, mask=valid[None, :], other=0.0), INTERPRET)
                lo, hi = _dequant_byte(wg, sg, byte, ASM, INTERPRET)
                acc_g = tl.dot(hi, x_hi, tl.dot(lo, x_lo, acc_g))
                lo, hi = _dequant_byte(wu, su, byte, ASM, INTERPRET)
                acc_u = tl.dot(hi, x_hi, tl.dot(lo, x_lo, acc_u))
    if SPLIT_K > 1:
        part = part_ptr + offs_m[None, :].to(tl.int64) * (2 * INTER) + offs_n[:, None]
        split = pid_k.to(tl.int64) * part_rows * (2 * INTER)
        tl.store(part + split, acc_g, mask=valid[None, :])
        tl.store(part + split + INTER, acc_u, mask=valid[None, :])
        tl.debug_barrier()  # every thread's partial sums before the count that publishes them
        done = tl.atomic_add(count_ptr + pid_m * (INTER // BLOCK_N) + pid_n, 1, sem="acq_rel", scope="gpu")
        last = done == SPLIT_K - 1
        if last:
            tl.debug_barrier()
            acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for sk in tl.static_range(SPLIT_K):
                at = part + sk * part_rows * (2 * INTER)
                acc_g += tl.load(at, mask=valid[None, :], other=0.0, cache_modifier=".cg")
                acc_u += tl.load(at + INTER, mask=valid[None, :], other=0.0, cache_modifier=".cg")
            _gate_up_epilogue(acc_g, acc_u, s2_ptr, e, h_ptr, offs_m, offs_n, INTER, H_BLOCK_K, ASM)
    else:
        _gate_up_epilogue(acc_g, acc_u, s2_ptr, e, h_ptr, offs_m, offs_n, INTER, H_BLOCK_K, ASM)


@triton.jit
def _gate_up_epilogue(
    acc_g, acc_u, s2_ptr, e, h_ptr, offs_m, offs_n, INTER: tl.constexpr, H_BLOCK_K: tl.constexpr, ASM: tl.constexpr
):
    """h = silu(a_g · gate) · (a_u · up) in bf16, stored in the down kernel's K-block permutation."""
    fix = 2.0**_ASM_SHIFT if ASM else 1.0
    g = acc_g * (tl.load(s2_ptr + 2 * e) * fix)
    u = acc_u * (tl.load(s2_ptr + 2 * e + 1) * fix)
    h = g * tl.sigmoid(g) * u  # [BLOCK_N, BLOCK_M]
    # Column n goes where the down kernel's H_BLOCK_K permutation wants it.
    within = offs_n % H_BLOCK_K
    col = offs_n - within + (within % 8) * (H_BLOCK_K // 8) + within // 8
    tl.store(h_ptr + offs_m[None, :].to(tl.int64) * INTER + col[:, None], h.to(tl.bfloat16))


@triton.jit
def _moe_down_kernel(
    h_ptr, w_ptr, s_ptr, s2_ptr, sorted_slot_ptr, block_expert_ptr, topk_w_ptr, y_ptr, w_desc, s_desc,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FUSE_K: tl.constexpr, ASM: tl.constexpr, INTERPRET: tl.constexpr,
    LAYOUT: tl.constexpr = 0, TMA: tl.constexpr = False, PDL: tl.constexpr = False, PAIRED: tl.constexpr = False,
    MASK_H: tl.constexpr = False,
):  # fmt: skip
    """Grid (H / BLOCK_N, blocks): one output tile per program (_down_tile); PAIRED as in
    _moe_gate_up_kernel."""
    _dependent_launch(PDL)
    e = tl.load(block_expert_ptr + tl.program_id(1))
    if e >= 0:
        _down_tile(
            h_ptr, w_ptr, s_ptr, s2_ptr, sorted_slot_ptr, e, topk_w_ptr, y_ptr, w_desc, s_desc,
            tl.program_id(0), tl.program_id(1), HIDDEN, INTER, BLOCK_M, BLOCK_N, BLOCK_K, FUSE_K, ASM, INTERPRET,
            LAYOUT, TMA, False, MASK_H,
        )  # fmt: skip
    elif PAIRED and e <= -2:
        _down_tile(
            h_ptr, w_ptr, s_ptr, s2_ptr, sorted_slot_ptr, -e - 2, topk_w_ptr, y_ptr, w_desc, s_desc,
            tl.program_id(0), tl.program_id(1), HIDDEN, INTER, 2 * BLOCK_M, BLOCK_N, BLOCK_K, FUSE_K, ASM,
            INTERPRET, LAYOUT, TMA, True, MASK_H,
        )  # fmt: skip


@triton.jit
def _down_tile(
    h_ptr, w_ptr, s_ptr, s2_ptr, sorted_slot_ptr, e, topk_w_ptr, y_ptr, w_desc, s_desc, pid_n, pid_m,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FUSE_K: tl.constexpr, ASM: tl.constexpr, INTERPRET: tl.constexpr,
    LAYOUT: tl.constexpr, TMA: tl.constexpr, PAIRED: tl.constexpr = False, MASK_H: tl.constexpr = False,
):  # fmt: skip
    """Output tile (pid_n, pid_m) of used block pid_m (local expert e): y = (a_2·W2 · h^T)^T ·
    routing weight for BLOCK_N hidden columns of the block's rows. MASK_H (re-laid-out and tiled
    weights): the block's padding rows of h (zeros, as the gate/up kernel writes them) are not
    read, only zero-filled: the same operands with less traffic from L2."""
    W: tl.constexpr = BLOCK_K // 8
    offs_m, slot, valid = _block_slots(sorted_slot_ptr, pid_m, BLOCK_M, PAIRED)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = e.to(tl.int64) * HIDDEN + offs_n
    offs_w = tl.arange(0, W)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for i in range(INTER // BLOCK_K):
        # h rows were written in this kernel's K-block permutation by the gate/up kernel.
        hp = h_ptr + offs_m[None, :].to(tl.int64) * INTER + i * BLOCK_K
        if LAYOUT >= 1:  # 2: tiled
            if TMA:
                wt, st = _load_tile_tma(w_desc, s_desc, (e * HIDDEN + pid_n * BLOCK_N) // 16, i, BLOCK_N, ASM)
            else:
                wt, st = _load_tile_v3(
                    w_ptr, s_ptr, rows, i, INTER // 8, INTER // 16, BLOCK_N, BLOCK_K, ASM, LAYOUT == 2
                )
            if MASK_H:
                hk = mma_operand(tl.load(hp + offs_k[:, None], mask=valid[None, :], other=0.0), INTERPRET)
            else:
                hk = mma_operand(tl.load(hp + offs_k[:, None]), INTERPRET)
            acc = tl.dot(_dequant_block_v3(wt, st, ASM, INTERPRET), hk, acc)
        elif FUSE_K:
            wt, st = _load_tile(w_ptr, s_ptr, rows, i, INTER // 8, INTER // 16, BLOCK_N, BLOCK_K, ASM)
            hk = mma_operand(tl.load(hp + offs_k[:, None]), INTERPRET)
            acc = tl.dot(_dequant_block(wt, st, ASM, INTERPRET), hk, acc)
        else:
            wt, st = _load_tile(w_ptr, s_ptr, rows, i, INTER // 8, INTER // 16, BLOCK_N, BLOCK_K, ASM)
            for byte in tl.static_range(4):
                hb = hp + 2 * byte * W + offs_w[:, None]
                lo, hi = _dequant_byte(wt, st, byte, ASM, INTERPRET)
                acc = tl.dot(lo, mma_operand(tl.load(hb), INTERPRET), acc)
                acc = tl.dot(hi, mma_operand(tl.load(hb + W), INTERPRET), acc)
    fix = 2.0**_ASM_SHIFT if ASM else 1.0
    route_w = tl.load(topk_w_ptr + slot, mask=valid, other=0.0)
    y = acc * (tl.load(s2_ptr + e) * fix) * route_w[None, :]
    tl.store(y_ptr + slot[None, :].to(tl.int64) * HIDDEN + offs_n[:, None], y.to(tl.bfloat16), mask=valid[None, :])


@triton.jit
def _moe_sum_kernel(
    y_ptr, ids_ptr, add_ptr, out_ptr, first_expert, num_local,
    HIDDEN: tl.constexpr, TOP_K: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr = False,
    INTERPRET: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    """out[t] = the sum over k of y[t, k] in float32 (then + add[t] with ADD), in out's dtype."""
    _dependent_launch(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(TOP_K):
        loc = tl.load(ids_ptr + t * TOP_K + j) - first_expert
        if (loc >= 0) & (loc < num_local):
            acc += tl.load(y_ptr + (t * TOP_K + j) * HIDDEN + offs, mask=offs < HIDDEN).to(tl.float32)
    if ADD:
        acc += tl.load(add_ptr + t * HIDDEN + offs, mask=offs < HIDDEN).to(tl.float32)
    tl.store(out_ptr + t * HIDDEN + offs, cast(acc, out_ptr.dtype.element_ty, INTERPRET), mask=offs < HIDDEN)


def _fit(block: int, dim: int, least: int) -> int:
    """The largest power of two <= block that divides dim; at least `least` (the MMA's smallest
    operand side, and 16-input scale groups on both halves of a K block)."""
    while block > least and dim % block:
        block //= 2
    if dim % block:
        raise ValueError(f"dimension {dim} is not a multiple of {least}, which the NVFP4 MoE kernels need")
    return block


def _reg_cap(cfg: dict) -> dict:
    """The launch option capping registers per thread (config key maxnreg), where one is set."""
    return {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}


# Up to this many rows per expert (256 tokens at 256 experts, top-8), 8-token blocks: Triton issues
# mma.sync m16n8k16 for them (wgmma m64n16k16 for 16), half the tensor-core work of 16-token blocks
# where an expert has at most 8 rows, and the kernels need ~128 registers instead of 169 / 212. The
# decode MoE runs at the H200's 700 W cap, so the MMA work saved is time. Measured on the H200 at
# GLM-5 shapes (bench/results/2026-12-04-triton-moe-block8.md: three runs, whole routed path, CUDA
# graphs), 16-token blocks against 8: 68.5 against 62.4 us at 1 token, 1438-1502 against 1273-1289
# at 64, 1711-1848 against 1602-1687 at 128. Where experts get more than 8 rows, two 8-token blocks
# would each dequantise the weights: at 256 tokens (~40% of the experts) 2021-2100 against 1724-1796
# us. So from PAIRED_FROM_PER_EXPERT rows per expert the align pads those experts' runs to 16 and
# their programs take 16-token blocks (paired_blocks), in the same launch: 1617-1732 us at 256. (A
# second launch for the pairs measured the same, 1720-1732; at 128 tokens pairing was 6% slower in
# one run and 7% faster in the other, so 128 stays unpaired.)
SMALL_BLOCK_PER_EXPERT = 8
PAIRED_FROM_PER_EXPERT = 4


def pick_block_m(num_slots: int, num_local: int) -> int:
    """Tokens per expert block. Each block re-reads and re-dequantises its expert's weights, but
    the MMA work grows with the block too: tokens are the MMA's N side, and at 64 the tensor cores
    take longer than the dequantisation (measured on the H200: 64 was 1.8x slower than 16 at one
    token, 32 8% slower at 256 tokens with one block per expert either way; 8 against 16 above
    SMALL_BLOCK_PER_EXPERT)."""
    per_expert = num_slots / max(1, num_local)
    if per_expert <= SMALL_BLOCK_PER_EXPERT:
        return 8
    if per_expert <= 96:
        return 32
    return 64


# The same pairing one size up: from 32 rows per expert (PROMPT_PRESETS' 32-token preset, below
# 64) the experts of more than 32 rows take 64-token blocks and the others 32, where a 64-token
# block for every expert gave half of them 32 or more rows of padding in their MMAs. Measured on
# an H100 at GLM-5 shapes (bench/results/2026-12-05-triton-moe-paired-32.md), whole routed path:
# 2686 against 2921-2923 us at 1024 tokens (32 rows per expert: the 1024-concurrent decode step).
# Below 32 rows per expert unpaired 32-token blocks stay ahead (2156 against 2203 us at 512
# tokens, 2345 against 2464 at 768).
PAIRED_32_FROM_PER_EXPERT = 32


def paired_blocks(block_m: int, num_slots: int, num_local: int) -> bool:
    """Whether block_m-token blocks run paired (experts with more than block_m rows in blocks of
    2 block_m, by the same programs): 8-token blocks above PAIRED_FROM_PER_EXPERT rows per expert,
    32-token blocks from PAIRED_32_FROM_PER_EXPERT."""
    per_expert = num_slots / max(1, num_local)
    if block_m == 8:
        return per_expert > PAIRED_FROM_PER_EXPERT
    return block_m == 32 and per_expert >= PAIRED_32_FROM_PER_EXPERT


# Steps with many rows per expert (prompts, and decode steps from 1024 rows): the MMA work grows
# with the rows, so 64-token blocks (each expert's weights dequantised once per 64 rows), wider
# gate/up tiles, 256-row down tiles and 8 warps. (rows per expert from, tokens per block, config.)
# Measured on the H200 at GLM-5 shapes, whole routed-expert path, CUDA-graph replays, against the
# defaults below 32 rows per expert (32-token blocks) and the 128-token-block preset that served
# from 512 rows per expert until 2026-12-02 (bench/results/2026-12-02-triton-moe-presets.md):
#   1024 tokens (32 rows per expert, the 1024-concurrent decode step): 2928 us against 3192-3206
#   (32-token blocks); 2048: 4300 against 4531-4556 (64-token blocks, 128-row down tiles, the
#   preset before) and 5887-6043 (32-token blocks, 2026-12-01); 4096: 7149 against 7389-7522;
#   8192: 12899 against 13640-13647; 16384: 24359-24384 against 25879-25880 (128-token blocks);
#   32768: 47016 against 49753. 256-row down tiles with 128-token blocks: 26539-26843 at 16384.
# At 16 and 24 rows per expert the 32-token defaults stay ahead (2206 against 2647 us at 512
# tokens, 2378 against 2842 at 768). From 32 to 64 rows per expert the same tiles take 32-token
# blocks, paired (paired_blocks: 64 rows for the experts of more than 32). In order: the first
# preset whose least rows per expert the step reaches is taken.
_PROMPT_TILES = {"gate_up": {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3}, "down": {"BLOCK_N": 256, "num_warps": 8}}
PROMPT_PRESETS = (
    (64, 64, _PROMPT_TILES),
    (PAIRED_32_FROM_PER_EXPERT, 32, _PROMPT_TILES),
)


def expected_local_slots(num_slots: int, num_local: int, num_experts: int | None) -> int:
    """The (token, k) slots this rank's experts can expect of `num_slots` under uniform routing:
    all of them without expert parallelism, num_local / num_experts of them with it. Block sizes
    follow this (a TP=8 rank's 32 of 256 experts see 8 rows each at 256 tokens, not 64); buffers
    stay sized for the worst case, every slot local (max_blocks)."""
    if not num_experts or num_experts <= num_local:
        return num_slots
    return -(-num_slots * num_local // num_experts)


def prompt_preset(num_slots: int, num_local: int) -> tuple[int, dict] | None:
    """(tokens per block, config) for a step with at least 32 rows per expert (32-token blocks,
    paired, below 64), or None (the defaults and pick_block_m)."""
    per_expert = num_slots / max(1, num_local)
    for least, block_m, config in PROMPT_PRESETS:
        if per_expert >= least:
            return block_m, config
    return None


def tile_descriptors(words: torch.Tensor, scales: torch.Tensor, block_n: int):
    """Tensor-memory-accelerator descriptors of a tiled stack (tile_nvfp4; int32 words of
    [E, R, K/8], uint8 scales of [E, R, K/16]) for K blocks of BLOCK_N rows: the words as [row
    groups, tiles per row, 16, TILE_K/8] and the scales as [row groups, tiles per row, 16,
    TILE_K/16], one block = BLOCK_N/16 groups' tiles of one K block."""
    experts, rows, kw = words.shape
    groups, tiles = experts * rows // TILE_ROWS, kw * 8 // TILE_K
    tw, ts = TILE_K // 8, TILE_K // 16
    return (
        TensorDescriptor(words, [groups, tiles, TILE_ROWS, tw], [tiles * TILE_ROWS * tw, TILE_ROWS * tw, tw, 1],
                         [block_n // TILE_ROWS, 1, TILE_ROWS, tw]),
        TensorDescriptor(scales, [groups, tiles, TILE_ROWS, ts], [tiles * TILE_ROWS * ts, TILE_ROWS * ts, ts, 1],
                         [block_n // TILE_ROWS, 1, TILE_ROWS, ts]),
    )  # fmt: skip


def max_blocks(num_slots: int, num_local: int, block_m: int, paired: bool = False) -> int:
    """Most BLOCK_M blocks any routing of num_slots slots over num_local experts can need (paired:
    runs of more than block_m slots padded to a multiple of 2 block_m, up to 2 blocks more each)."""
    return triton.cdiv(num_slots, block_m) + (2 if paired else 1) * min(num_local, num_slots)


# FUSE_K: one MMA per K block on the whole dequantised tile (asynchronous: the MMAs overlap the
# next dequantisation) rather than 8 partial MMAs, each of which waited for completion.
# TMA: the weight tiles through tensor-memory-accelerator descriptors (tiled layout only); measured
# no faster on the H200 at 1-256 tokens, with or without register caps and at 2-5 stages
# (bench/results/2026-12-02-triton-moe-occupancy). PDL (set per call unless a config sets it): see
# _dependent_launch and SMALL_BATCH_PDL. Persistent kernels (a fixed grid striding over the used
# blocks' tiles) were timed at 0.72-0.96x the speed of one program per tile at 1-256 tokens and
# removed (bench/results/2026-12-02-triton-moe-persistent). The down config's GLUON (with STAGES,
# PROGRAMS_PER_SM, maxnreg) runs gluon_moe_down's persistent kernel instead of _moe_down_kernel
# (tiled layout, 16- or 32-token blocks, Hopper): the same bits, within -2% to +1% of its time at
# 64-256 tokens (bench/results/2026-12-04-gluon-moe-down.md), so off by default.
DEFAULT_CONFIG = {
    "gate_up": {"BLOCK_N": 64, "BLOCK_K": 256, "FUSE_K": True, "num_warps": 4, "num_stages": 3, "TMA": False},
    # 128 rows: fewer wgmma fences and address updates per value; the down kernel has one weight
    # tile where gate/up has two.
    "down": {"BLOCK_N": 128, "BLOCK_K": 256, "FUSE_K": True, "num_warps": 4, "num_stages": 3, "TMA": False},
}

# The down config's MASK_H (see _down_tile) is off: at 256 tokens a block's h rows are about a
# fifth of what each down program reads from L2, and ncu put L2 at 80-88% of its peak there, but
# one H200 run measured only -2.5% at 64 tokens and -0.5% at 256 (bench/results/
# 2026-12-05-triton-moe-slot-blocks-and-mask-h.md).

# Not here: slot blocks for one-token steps (each (token, k) slot its own block, so no align, and
# the down projection and the sum in one launch). Built, bit-identical, and 2.2x slower on the H200
# (141 against 65 us at one token: each fused down+sum program streamed a token's eight experts one
# after another; same file as above), so removed; bench/kernels/NOTES.md has the account.

# Gate/up register cap for 16-token blocks (decode sizes): ptxas fits the kernel in 158 registers
# without spilling (169 uncapped), so three programs share a multiprocessor instead of two (ncu at
# 256 tokens: two, held there by registers, issuing on 64% of cycles). Measured on the H200
# (bench/results/2026-12-02-triton-moe-occupancy), whole path, capped against uncapped in the same
# run: 1388 / 1490 us at 64 tokens, 1742 / 1816 at 256, 72.1 / 72.0 at 1. With 32-token blocks
# (1024 tokens) the cap made it slower (3484 against 3126 us), so it stays on 16-token blocks.
DECODE_GATE_UP_MAXNREG = 168

# Programmatic dependent launches up to this many tokens: measured at one token 70.1 against 72.1 us
# (and 72.3 against 74.9 in another run); at 64 and 256 tokens no better (1424 / 1388, 1804 / 1742).
SMALL_BATCH_PDL = 8


def moe_experts_nvfp4_triton(
    x: torch.Tensor,  # bf16 [T, H]
    expert_ids: torch.Tensor,  # int [T, k], global expert ids
    expert_weights: torch.Tensor,  # float32 [T, k]
    w13: torch.Tensor,  # uint8 [E, 2I, H/2]
    w13_scale: torch.Tensor,  # float8_e4m3fn [E, 2I, H/16]
    w13_scale_2: torch.Tensor,  # float32 [E, 2]
    w2: torch.Tensor,  # uint8 [E, H, I/2]
    w2_scale: torch.Tensor,  # float8_e4m3fn [E, H, I/16]
    w2_scale_2: torch.Tensor,  # float32 [E, 1]
    first_expert: int = 0,
    *,
    block_m: int | None = None,
    config: dict | None = None,
    asm: bool | None = None,
    relayout: bool = False,
    tiled: bool = False,
    num_experts: int | None = None,
    add: torch.Tensor | None = None,
    paired: bool | None = None,
) -> torch.Tensor:
    """Sum over the token's chosen experts that live on this rank -> float32 [T, H]. relayout: the
    weights and scales are in relayout_nvfp4's layout (uint8 scales), not the checkpoint's; tiled:
    and then in tile_nvfp4's tiles (hidden and intermediate sizes multiples of 256, K blocks of 256).
    num_experts: the layer's routed experts on all ranks (default: this rank's), for block sizes.
    add ([T, H]): added to the float32 sum, and the result rounded to add's dtype: exactly
    (sum + add.float()).to(add.dtype), in the sum's own launch (the MoE block's shared experts).
    paired (default: paired_blocks): experts with more than block_m rows run as blocks of 2 block_m
    rows, the others as blocks of block_m, in the same launch of each kernel."""
    num_tokens, hidden = x.shape
    top_k = expert_ids.shape[1]
    num_local, two_inter, _ = w13.shape
    inter = two_inter // 2
    if w2.shape != (num_local, hidden, inter // 2):
        raise ValueError(f"w2 shape {tuple(w2.shape)} does not match w13 {tuple(w13.shape)} and hidden {hidden}")
    n_slots = num_tokens * top_k
    sizing_slots = expected_local_slots(n_slots, num_local, num_experts)
    if block_m is None and config is None:
        block_m, config = prompt_preset(sizing_slots, num_local) or (None, None)
    cfg = {k: {**v, **(config or {}).get(k, {})} for k, v in DEFAULT_CONFIG.items()}
    # K blocks of at least 128: each of the 8 partial dots of a block needs K >= 16.
    gu = {
        **cfg["gate_up"],
        "BLOCK_N": _fit(cfg["gate_up"]["BLOCK_N"], inter, 16),
        "BLOCK_K": _fit(cfg["gate_up"]["BLOCK_K"], hidden, 128),
    }
    down_cfg = cfg["down"]
    if relayout and num_tokens == 1 and "BLOCK_N" not in (config or {}).get("down", {}):
        # One token: 64 rows per down program, 119 registers instead of 212, so twice the programs and
        # more of them per SM (measured with re-laid-out weights: 85.8 against 89.4-91.6 us; the
        # same at 256 tokens, 1920 against 1912 us, so larger batches keep 128).
        down_cfg = {**down_cfg, "BLOCK_N": 64, "num_stages": 3}
    dn = {
        **down_cfg,
        "BLOCK_N": _fit(down_cfg["BLOCK_N"], hidden, 16),
        "BLOCK_K": _fit(down_cfg["BLOCK_K"], inter, 128),
    }
    if asm is None:
        asm = x.is_cuda and not _INTERPRET
    if relayout and (w13_scale.dtype != torch.uint8 or w2_scale.dtype != torch.uint8):
        raise ValueError("relayout=True takes relayout_nvfp4's uint8 scales")
    if tiled and not relayout:
        raise ValueError("tiled=True takes re-laid-out weights (relayout=True)")
    if (gu["TMA"] or dn["TMA"]) and not tiled:
        raise ValueError("TMA loads read the tiled layout (tiled=True)")
    if tiled and (gu["BLOCK_K"] != TILE_K or dn["BLOCK_K"] != TILE_K):
        raise ValueError(f"the tiled layout needs K blocks of {TILE_K} (hidden {hidden}, intermediate {inter})")
    layout = 2 if tiled else 1 if relayout else 0
    if add is not None and add.shape != (num_tokens, hidden):
        raise ValueError(f"add has shape {tuple(add.shape)}, expected {(num_tokens, hidden)}")
    if n_slots == 0:
        out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
        return out if add is None else (out + add.float()).to(add.dtype)
    bm = block_m or pick_block_m(sizing_slots, num_local)
    if paired is None:
        paired = paired_blocks(bm, sizing_slots, num_local)
    if paired and (gu.get("SPLIT_K", 1) > 1 or dn.get("GLUON")):
        raise ValueError("paired blocks take neither SPLIT_K nor the Gluon down kernel")
    # The gate/up register cap of 16-token blocks (paired 8-token blocks included: the kernel has
    # their 16-token path), unless configured.
    if 16 in (bm, 2 * bm if paired else bm) and "maxnreg" not in (config or {}).get("gate_up", {}):
        gu = {**gu, "maxnreg": DECODE_GATE_UP_MAXNREG}
    # Programmatic dependent launch is a CUDA launch option: never in the interpreter.
    on_gpu = x.is_cuda and not _INTERPRET
    gu["PDL"] = on_gpu and gu.get("PDL", num_tokens <= SMALL_BATCH_PDL)
    dn["PDL"] = on_gpu and dn.get("PDL", num_tokens <= SMALL_BATCH_PDL)
    nblocks = max_blocks(n_slots, num_local, bm, paired)
    rows = nblocks * bm
    dev = x.device
    ids = expert_ids.contiguous()
    routing_w = expert_weights.float().contiguous()
    w13_words = w13.view(torch.int32)
    gu_desc = tile_descriptors(w13_words, w13_scale, gu["BLOCK_N"]) if gu["TMA"] else (w13_words, w13_scale)
    sorted_slot, block_expert, xp = _align(x, ids, first_expert, num_local, bm, nblocks, gu["BLOCK_K"], paired=paired)

    h = torch.empty(rows, inter, dtype=torch.bfloat16, device=dev)
    split_k = gu.get("SPLIT_K", 1)
    if (hidden // gu["BLOCK_K"]) % split_k:
        raise ValueError(f"SPLIT_K {split_k} does not divide {hidden // gu['BLOCK_K']} K blocks")
    if split_k > 1:
        part = torch.empty(split_k, rows, 2 * inter, dtype=torch.float32, device=dev)
        count = torch.zeros(nblocks * (inter // gu["BLOCK_N"]), dtype=torch.int32, device=dev)
    else:
        part, count = h, sorted_slot  # not read
    _moe_gate_up_kernel[(inter // gu["BLOCK_N"], nblocks, split_k)](
        xp, w13_words, w13_scale, w13_scale_2, sorted_slot, block_expert, h, part, count, *gu_desc, top_k, rows,
        first_expert, num_local,
        K=hidden, INTER=inter, BLOCK_M=bm, BLOCK_N=gu["BLOCK_N"], BLOCK_K=gu["BLOCK_K"], H_BLOCK_K=dn["BLOCK_K"], FUSE_K=gu["FUSE_K"],
        ASM=asm, INTERPRET=_INTERPRET, LAYOUT=layout, SPLIT_K=split_k, TMA=gu["TMA"], PDL=gu["PDL"], launch_pdl=gu["PDL"],
        PAIRED=paired, num_warps=gu["num_warps"], num_stages=gu["num_stages"], **_reg_cap(gu),
    )  # fmt: skip

    # bf16 per-slot outputs, like the reference's per-expert matmuls; summed in float32.
    y = torch.empty(n_slots, hidden, dtype=torch.bfloat16, device=dev)
    w2_words = w2.view(torch.int32)
    dn_desc = tile_descriptors(w2_words, w2_scale, dn["BLOCK_N"]) if dn["TMA"] else (w2_words, w2_scale)
    if dn.get("GLUON"):
        from . import gluon_moe_down

        if not (tiled and asm and gluon_moe_down.takes(hidden, inter, bm, dev)):
            raise ValueError(
                "the Gluon down kernel takes tiled weights, the inline-assembly path and 16- or 32-token blocks, on Hopper"
            )
        gluon_moe_down.moe_down_gluon(
            h, w2_words, w2_scale, w2_scale_2, sorted_slot, block_expert, routing_w, y, bm, 2.0**_ASM_SHIFT.value,
            stages=dn.get("STAGES"), programs_per_sm=dn.get("PROGRAMS_PER_SM"),
            maxnreg=dn.get("maxnreg", gluon_moe_down.MAXNREG),
        )  # fmt: skip
    else:
        _moe_down_kernel[(hidden // dn["BLOCK_N"], nblocks)](
            h, w2_words, w2_scale, w2_scale_2, sorted_slot, block_expert, routing_w, y, *dn_desc,
            HIDDEN=hidden, INTER=inter, BLOCK_M=bm, BLOCK_N=dn["BLOCK_N"], BLOCK_K=dn["BLOCK_K"], FUSE_K=dn["FUSE_K"],
            ASM=asm, INTERPRET=_INTERPRET, LAYOUT=layout, TMA=dn["TMA"], PDL=dn["PDL"], launch_pdl=dn["PDL"],
            PAIRED=paired, MASK_H=dn.get("MASK_H", False), num_warps=dn["num_warps"], num_stages=dn["num_stages"],
            **_reg_cap(dn),
        )  # fmt: skip

    out = torch.empty(num_tokens, hidden, dtype=torch.float32 if add is None else add.dtype, device=dev)
    block = min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block))](
        y, ids, y if add is None else add.contiguous(), out, first_expert, num_local, HIDDEN=hidden, TOP_K=top_k,
        BLOCK=block, ADD=add is not None, INTERPRET=_INTERPRET or not x.is_cuda, PDL=dn["PDL"], launch_pdl=dn["PDL"],
        num_warps=4,
    )  # fmt: skip
    return out


# The layout the model's backend puts its NVFP4 expert stacks in, once, before the first forward
# (in place; the torch reference reads every layout): "tiled" (the default: re-laid out, then in
# 16 x 256 tiles; stacks that are not whole tiles get "relayout"), "relayout" or "checkpoint" (as
# loaded). Measured on the H200 at GLM-5 shapes, whole routed-expert path at batch 1 / 64 / 256 /
# 1024 (bench/results/2026-12-01-triton-moe-tiled): checkpoint 93.6 / 1765 / 2277 / 3645 us,
# relayout 84.8 / 1677 / 2023 / 3488, tiled 72.4 / 1549 / 1853 / 3126; in the model's decode step
# at 256 x 1400 the experts took 10.4 ms tiled against 11.2 ms re-laid out.
STACK_LAYOUTS = ("checkpoint", "relayout", "tiled")
STACK_LAYOUT = os.environ.get("NSASERVE_MOE_LAYOUT", "tiled")
if STACK_LAYOUT not in STACK_LAYOUTS:
    raise ValueError(f"NSASERVE_MOE_LAYOUT={STACK_LAYOUT!r}: expected one of {', '.join(STACK_LAYOUTS)}")


def stacks_to_kernel_layout(w13, w2, layout: str | None = None) -> None:
    """Put one MoE layer's NVFP4 ExpertStacks in the layout (default STACK_LAYOUT) the kernels read.
    Tiled only where both stacks are whole tiles (the kernels take one layout for both)."""
    layout = layout or STACK_LAYOUT
    if layout == "checkpoint":
        return
    if layout == "tiled" and not (w13.can_tile() and w2.can_tile()):
        layout = "relayout"
    w13.to_kernel_layout(layout)
    w2.to_kernel_layout(layout)


def moe_experts_triton(x, expert_ids, expert_weights, w13, w2, first_expert: int, add=None) -> torch.Tensor:
    """The registry's ("moe_experts", "triton") backend: like moe_experts_torch, but w13 / w2 are
    the model's NVFP4 ExpertStacks (model/expert_stack.py), read in their quantised layout (put in
    STACK_LAYOUT on the first call, when the runner has not done so at load). add: as
    moe_experts_nvfp4_triton's (this backend only)."""
    if w13.precision != NVFP4 or w2.precision != NVFP4:
        raise ValueError(f"the triton MoE backend runs NVFP4 experts, got {w13.precision}/{w2.precision}")
    stacks_to_kernel_layout(w13, w2)
    if w13.kernel_layout != w2.kernel_layout:
        raise ValueError(f"w13 and w2 are in different layouts ({w13.kernel_layout}, {w2.kernel_layout})")
    layout = w13.kernel_layout
    relayout = layout != "checkpoint"
    s13, s2 = (
        (w13.weight_scale.view(torch.uint8), w2.weight_scale.view(torch.uint8))
        if relayout
        else (w13.weight_scale, w2.weight_scale)
    )
    return moe_experts_nvfp4_triton(
        x, expert_ids, expert_weights,
        w13.weight, s13, w13.weight_scale_2,
        w2.weight, s2, w2.weight_scale_2,
        first_expert, relayout=relayout, tiled=layout == "tiled", num_experts=w13.num_experts, add=add,
    )  # fmt: skip
