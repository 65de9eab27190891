"""Sparse MLA decode in Gluon with warp specialisation (Hopper only): three warpgroups with one job
each, so the tensor cores, the softmax and the gather / dequantisation overlap.

Same math, arguments and outputs as gluon_sparse_mla.sparse_mla_decode_gluon:
    s[t, h, j] = scale * (q_lat[t, h] . c[slot_tj] + q_pe[t, h] . k_pe[slot_tj]),  o = softmax(s) @ c

Why: in gluon_sparse_mla every warp does every stage in lock step (gather issue, QK^T, a softmax
whose row statistics cross the warpgroups, PV, the FP8 dequantisation), so the tensor cores sit
idle while the warps run the softmax and dequantise: a 64-row block took ~8,000 cycles at batch 256
where its products need ~3,100 (bench/kernels/NOTES.md). Here (the roles FlashMLA's Hopper FP8
decode kernel uses for 64 heads; our own code):
- the softmax warpgroup (the default partition) computes S = q C^T for the whole block (64 heads x
  64 keys, K = 576), the online softmax, hands P (bf16) and the rescale factors to the second
  warpgroup through shared memory, and accumulates the left half of O (columns 0-255) from P in
  registers;
- the second warpgroup rescales and accumulates the right half of O (columns 256-511) from P in
  shared memory, so its PV runs while the first warpgroup computes the next block's QK^T;
- the producer warpgroup gathers the next block's rows into the other of two row buffers: for an
  FP8 cache it loads a block's codes into registers before it waits for the block's buffer (their
  latency overlaps the consumers' work whenever the producer runs ahead), then dequantises them
  into shared memory (by bit operations and exact bf16 multiplies: code x power-of-two group scale,
  the same bits as float32 rounded to bf16, as every other kernel reads the cache); for a bf16
  cache it copies the rows by cp.async. Over FP8 this producer is the slower side
  (bench/results/2026-12-04-gluon-sparse-mla-ws.md). The softmax warpgroup copies q into shared
  memory while the producer gathers block 0.
mbarriers order them: full[b] (rows in buffer b), empty[b] (both warpgroups done with buffer b),
p_full / p_empty (P and its factors), l_full (the final row sums for the right half's epilogue).
Shared memory: q 72 KB + two row buffers 144 KB + P 8 KB, so one program per multiprocessor.

Splits, the -1 entries and the trimmed loop end are as in gluon_sparse_mla (the same plan_splits
and combine_splits); only 64-row blocks of whole 64-head blocks.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gluon_sparse_mla import _load_slots, _store_fp8_rows, list_part, ordered_part, work_part
from .triton_sparse_mla import TRIM_SCAN, cache_views, combine_splits, plan_launch, plan_pointer

BLOCK_H = gl.constexpr(64)  # heads per program: one warpgroup's MMA M
BLOCK_N = gl.constexpr(64)  # keys per block
WG = gl.constexpr(4)  # warps per partition
# Registers per thread of the two worker partitions (setmaxnreg); the softmax warpgroup gets the
# rest of the multiprocessor's 64K, 232 (it holds S, P and half of O). With less for the PV
# warpgroup (half of O, 128) ptxas ignores every setmaxnreg (its note C7507); the producer spills
# 12 bytes at 112 (5 spill instructions; compile_sm90.py checks the two notes).
PV_REGS = gl.constexpr(160)
PRODUCER_REGS = gl.constexpr(112)
# q comes into shared memory by cp.async in the softmax partition, while the producer already
# gathers block 0, rather than before the partitions start: 1-2% faster at 64-256 tokens over
# either cache (bench/results/2026-12-04-gluon-sparse-mla-fp8-bits-r1, -r2). Same bits.
Q_IN_PARTITION = True
# FP8 codes dequantised by bit operations (gluon_sparse_mla._E4M3_BF16_ASM): 1.5-4.5% faster than
# through float32 here at 64-256 tokens (the producer is the bound), same bits for the cache's
# power-of-two scales. False: through float32, for A/B runs.
FP8_DEQUANT_BITS = True


@gluon.constexpr_function
def _pe_layout(P):
    """k_pe rows [rows, P] over one warpgroup: 8 consecutive values a thread."""
    return gl.BlockedLayout([1, 8], [32 // (P // 8), P // 8], [WG, 1], [1, 0])


# bf16 rows [rows, R] over one warpgroup: 8 consecutive values a thread, a row over a warp.
_ROWS_L = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [WG, 1], [1, 0]))


@gluon.constexpr_function
def _codes_layout(R, G):
    """FP8 codes [rows, R / G, G] over one warpgroup: 16 consecutive codes a thread, a row over a warp."""
    return gl.BlockedLayout([1, 1, 16], [1, R // G, 32 // (R // G)], [WG, 1, 1], [2, 1, 0])


@gluon.jit
def _load_codes(cache_ptr, cache_f32_ptr, idx_ptr, t, idx_stride, j, j1,
                R: gl.constexpr, G: gl.constexpr, ROW_BYTES: gl.constexpr, ROWS: gl.constexpr):  # fmt: skip
    """Codes [ROWS, R / G, G] (uint8) and group scales [ROWS, R / G] of list entries j .. j + ROWS,
    loads issued (zeros for invalid entries)."""
    codes_l: gl.constexpr = _codes_layout(R, G)
    sc_l: gl.constexpr = gl.SliceLayout(2, codes_l)
    valid, slot = _load_slots(idx_ptr, t, idx_stride, j, j1, ROWS, gl.SliceLayout(1, sc_l))
    offs_g = gl.arange(0, R // G, layout=gl.SliceLayout(0, sc_l))
    offs_e = gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(1, codes_l)))
    at = slot[:, None] * ROW_BYTES + offs_g[None, :] * G
    codes = gl.load(cache_ptr + at[:, :, None] + offs_e[None, None, :], mask=valid[:, None, None], other=0)
    sc = gl.load(
        cache_f32_ptr + slot[:, None] * (ROW_BYTES // 4) + R // 4 + offs_g[None, :], mask=valid[:, None], other=0.0
    )
    return codes, sc


@gluon.jit
def _gather_pe(pe_buf, ptr, idx_ptr, t, idx_stride, j, j1, ROW: gl.constexpr, AT: gl.constexpr, P: gl.constexpr):
    """cp.async the k_pe of list entries j .. j + BLOCK_N (P bf16 values at element AT of rows of ROW
    bf16 elements) into pe_buf [BLOCK_N, P]."""
    valid, slot = _load_slots(idx_ptr, t, idx_stride, j, j1, BLOCK_N, gl.SliceLayout(1, _pe_layout(P)))
    offs_p = gl.arange(0, P, layout=gl.SliceLayout(0, _pe_layout(P)))
    async_copy.async_copy_global_to_shared(
        pe_buf, ptr + slot[:, None] * ROW + AT + offs_p[None, :], mask=valid[:, None]
    )


@gluon.jit
def _load_half(cache_ptr, cache_f32_ptr, idx_ptr, t, idx_stride, j, j1,
               R: gl.constexpr, G: gl.constexpr, ROW_BYTES: gl.constexpr):  # fmt: skip
    """The codes and scales of list entries j .. j + BLOCK_N / 2 as four eighths of the block, loads issued."""
    E: gl.constexpr = BLOCK_N // 8
    c0, s0 = _load_codes(cache_ptr, cache_f32_ptr, idx_ptr, t, idx_stride, j, j1, R, G, ROW_BYTES, E)
    c1, s1 = _load_codes(cache_ptr, cache_f32_ptr, idx_ptr, t, idx_stride, j + E, j1, R, G, ROW_BYTES, E)
    c2, s2 = _load_codes(cache_ptr, cache_f32_ptr, idx_ptr, t, idx_stride, j + 2 * E, j1, R, G, ROW_BYTES, E)
    c3, s3 = _load_codes(cache_ptr, cache_f32_ptr, idx_ptr, t, idx_stride, j + 3 * E, j1, R, G, ROW_BYTES, E)
    return c0, s0, c1, s1, c2, s2, c3, s3


@gluon.jit
def _store_rows_half(c_buf, c0, s0, c1, s1, c2, s2, c3, s3, row0, R: gl.constexpr, BITS: gl.constexpr):
    """Dequantise four eighths (_load_half) into rows row0 .. row0 + BLOCK_N / 2 of c_buf."""
    E: gl.constexpr = BLOCK_N // 8
    _store_fp8_rows(c_buf, c0, s0, row0, R, E, BITS)
    _store_fp8_rows(c_buf, c1, s1, row0 + E, R, E, BITS)
    _store_fp8_rows(c_buf, c2, s2, row0 + 2 * E, R, E, BITS)
    _store_fp8_rows(c_buf, c3, s3, row0 + 3 * E, R, E, BITS)


@gluon.jit
def _producer(c_smem, pe_smem, full, empty, cache_ptr, cache_f32_ptr, cache_bf16_ptr, idx_ptr, t, idx_stride, j0, j1,
              n_blocks, R: gl.constexpr, P: gl.constexpr, G: gl.constexpr, ROW_BYTES: gl.constexpr,
              FP8: gl.constexpr, BITS: gl.constexpr):  # fmt: skip
    """Fill buffer i % 2 with block i's rows (bf16) once both warpgroups are done with block i - 2."""
    H: gl.constexpr = BLOCK_N // 2
    if FP8:
        for i in range(n_blocks):
            b = i % 2
            j = j0 + i * BLOCK_N
            # The codes are loaded into registers before the wait for the buffer, so their latency
            # runs while the consumers finish with it. (Loading them a block ahead, carried across
            # the loop, spills heavily at this partition's 112 registers, even half a block.)
            a = _load_half(cache_ptr, cache_f32_ptr, idx_ptr, t, idx_stride, j, j1, R, G, ROW_BYTES)
            z = _load_half(cache_ptr, cache_f32_ptr, idx_ptr, t, idx_stride, j + H, j1, R, G, ROW_BYTES)
            mbarrier.wait(empty.index(b), ((i // 2) & 1) ^ 1)  # the first two pass at once
            _gather_pe(pe_smem.index(b), cache_bf16_ptr, idx_ptr, t, idx_stride, j, j1, ROW_BYTES // 2,
                       (R + 4 * (R // G)) // 2, P)  # fmt: skip
            async_copy.commit_group()
            c_buf = c_smem.index(b)
            _store_rows_half(c_buf, *a, 0, R, BITS)
            _store_rows_half(c_buf, *z, H, R, BITS)
            async_copy.wait_group(0)
            fence_async_shared()  # generic-proxy stores and copies, then read by the MMAs' async proxy
            mbarrier.arrive(full.index(b))
    else:
        offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, _ROWS_L))
        for i in range(n_blocks):
            b = i % 2
            j = j0 + i * BLOCK_N
            mbarrier.wait(empty.index(b), ((i // 2) & 1) ^ 1)
            valid, slot = _load_slots(idx_ptr, t, idx_stride, j, j1, BLOCK_N, gl.SliceLayout(1, _ROWS_L))
            async_copy.async_copy_global_to_shared(
                c_smem.index(b), cache_ptr + slot[:, None] * (R + P) + offs_r[None, :], mask=valid[:, None]
            )
            _gather_pe(pe_smem.index(b), cache_ptr, idx_ptr, t, idx_stride, j, j1, R + P, R, P)
            async_copy.commit_group()
            async_copy.wait_group(0)
            fence_async_shared()
            mbarrier.arrive(full.index(b))


@gluon.jit
def _store_half(acc, l_i, m_i, o_ptr, lse_ptr, t, sp, h0, heads, num_splits, col0: gl.constexpr,
                R: gl.constexpr, HALF: gl.constexpr, SPLIT: gl.constexpr, o_l: gl.constexpr, WITH_LSE: gl.constexpr):  # fmt: skip
    """Columns col0 .. col0 + HALF of the normalised output (float32 parts and, WITH_LSE, the
    log-sum-exps when SPLIT)."""
    has = l_i > 0.0
    out = acc / gl.where(has, l_i, 1.0)[:, None]
    offs_h = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_l))
    offs_r = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_l))
    hmask = offs_h < heads
    if SPLIT:
        part = (t * num_splits + sp).to(gl.int64) * heads + offs_h
        gl.store(o_ptr + part[:, None] * R + offs_r[None, :], out, mask=hmask[:, None])
        if WITH_LSE:
            gl.store(lse_ptr + part, gl.where(has, m_i + gl.log2(l_i), float("-inf")), mask=hmask)
    else:
        rows = (t * heads + offs_h).to(gl.int64)
        gl.store(o_ptr + rows[:, None] * R + offs_r[None, :], out.to(o_ptr.dtype.element_ty), mask=hmask[:, None])


@gluon.jit
def _copy_q(q_smem, qpe_smem, q_lat_ptr, q_pe_ptr, t, h0, heads, R: gl.constexpr, P: gl.constexpr):
    """cp.async this program's q rows (zeros past `heads`) and q_pe into shared memory, waited for
    and visible to the warpgroup's MMAs on return."""
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WG, 1], [1, 0])
    offs_qh = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_l))
    offs_qr = gl.arange(0, R, layout=gl.SliceLayout(0, q_l))
    rows = (t * heads + offs_qh).to(gl.int64)
    async_copy.async_copy_global_to_shared(
        q_smem, q_lat_ptr + rows[:, None] * R + offs_qr[None, :], mask=(offs_qh < heads)[:, None]
    )
    offs_ph = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, _pe_layout(P)))
    offs_pp = gl.arange(0, P, layout=gl.SliceLayout(0, _pe_layout(P)))
    async_copy.async_copy_global_to_shared(
        qpe_smem, q_pe_ptr + (t * heads + offs_ph).to(gl.int64)[:, None] * P + offs_pp[None, :],
        mask=(offs_ph < heads)[:, None],
    )  # fmt: skip
    async_copy.commit_group()
    async_copy.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()  # every thread's rows


@gluon.jit
def _softmax_wg(q_smem, qpe_smem, c_smem, pe_smem, p_smem, alpha_smem, l_smem, full, empty, p_full, p_empty, l_full,
                idx_ptr, o_ptr, lse_ptr, t, sp, h0, heads, idx_stride, num_splits, j0, j1, n_blocks, scale_log2,
                q_lat_ptr, q_pe_ptr, R: gl.constexpr, P: gl.constexpr, SPLIT: gl.constexpr,
                Q_HERE: gl.constexpr):  # fmt: skip
    """The default partition: S, the online softmax, P to the PV warpgroup, O's left half. Q_HERE: q
    comes into shared memory here (while the producer gathers block 0), not before the partitions."""
    if Q_HERE:
        _copy_q(q_smem, qpe_smem, q_lat_ptr, q_pe_ptr, t, h0, heads, R, P)
    HALF: gl.constexpr = R // 2
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WG, 1], instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WG, 1], instr_shape=[16, HALF, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    m_i = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_l))  # finite: a masked block adds 0
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, s_l))
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_l)
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_l)
    idx_row = idx_ptr + t.to(gl.int64) * idx_stride
    for i in range(n_blocks):
        b = i % 2
        offs = j0 + i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
        valid = gl.load(idx_row + offs, mask=offs < j1, other=-1) >= 0
        mbarrier.wait(full.index(b), (i // 2) & 1)
        c_buf = c_smem.index(b)
        s = warpgroup_mma(q_smem, c_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(qpe_smem, pe_smem.index(b).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        s = gl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p16 = p.to(gl.bfloat16)
        mbarrier.wait(p_empty, (i & 1) ^ 1)  # the PV warpgroup has read block i - 1's P
        p_smem.store(p16)
        alpha_smem.store(alpha)
        fence_async_shared()
        mbarrier.arrive(p_full)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        # Waited for at once: a PV left in flight into the next block (across the loop's back edge)
        # makes ptxas serialise every wgmma of the kernel (its C7515 warning), whatever else the
        # loop does. The PV warpgroup's half overlaps this warpgroup's next block instead.
        acc = warpgroup_mma(gl.convert_layout(p16, p_l), c_buf.slice(0, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(b))  # this warpgroup's last read of the buffer
    l_smem.store(l_i)
    mbarrier.arrive(l_full)
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_l))
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_l))
    _store_half(acc, l_o, m_o, o_ptr, lse_ptr, t, sp, h0, heads, num_splits, 0, R, HALF, SPLIT, o_l, True)


@gluon.jit
def _pv_wg(c_smem, p_smem, alpha_smem, l_smem, empty, p_full, p_empty, l_full, o_ptr, lse_ptr, t, sp, h0, heads,
           num_splits, n_blocks, R: gl.constexpr, SPLIT: gl.constexpr):  # fmt: skip
    """Worker: O's right half from P in shared memory, rescaled by the softmax warpgroup's factors."""
    HALF: gl.constexpr = R // 2
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WG, 1], instr_shape=[16, HALF, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, o_l)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_l)
    for i in range(n_blocks):
        b = i % 2
        mbarrier.wait(p_full, i & 1)
        acc = acc * alpha_smem.load(row_l)[:, None]
        acc = warpgroup_mma(p_smem, c_smem.index(b).slice(HALF, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(p_empty)
        mbarrier.arrive(empty.index(b))
    mbarrier.wait(l_full, 0)
    l_o = l_smem.load(row_l)
    _store_half(acc, l_o, l_o, o_ptr, lse_ptr, t, sp, h0, heads, num_splits, HALF, R, HALF, SPLIT, o_l, False)


@gluon.jit(do_not_specialize=["topk", "split_len"])
def _sparse_mla_ws_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, cache_f32_ptr, cache_bf16_ptr, idx_ptr, o_ptr, lse_ptr, work_ptr,
    heads, topk, idx_stride, num_splits, scale_log2, split_len,
    R: gl.constexpr, P: gl.constexpr, G: gl.constexpr, ROW_BYTES: gl.constexpr,
    FP8: gl.constexpr, SPLIT: gl.constexpr, TRIM: gl.constexpr, TRIM_LEN: gl.constexpr, BITS: gl.constexpr = True,
    Q_HERE: gl.constexpr = True, WORK: gl.constexpr = False, ORDER: gl.constexpr = False,
):  # fmt: skip
    if WORK:  # the step's plan: program p runs entries [j0, j1) of row t
        t, sp, j0, j1, n_blocks = work_part(work_ptr, BLOCK_N)
        if t < 0:  # a spare program
            return
    elif ORDER:  # the step's row order: program p runs a split of the row the order puts p-th
        t, sp, j0, j1, n_blocks = ordered_part(work_ptr, split_len, topk, BLOCK_N)
    else:
        t = gl.program_id(0)
        sp = gl.program_id(1)
    h0 = gl.program_id(2) * BLOCK_H
    q_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    pe_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * P), element_bitwidth=16, rank=2)
    p_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    vec_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, R], q_sl)
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, P], pe_sl)
    if not Q_HERE:
        _copy_q(q_smem, qpe_smem, q_lat_ptr, q_pe_ptr, t, h0, heads, R, P)
    c_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, R], q_sl)
    pe_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, P], pe_sl)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], p_sl)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_sl)
    l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_sl)
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    l_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(full.index(b), count=1)
        mbarrier.init(empty.index(b), count=2)  # both warpgroups
    mbarrier.init(p_full, count=1)
    mbarrier.init(p_empty, count=1)
    mbarrier.init(l_full, count=1)
    fence_async_shared()  # q for the MMAs; the barriers' initialisation for every partition

    if not (WORK or ORDER):
        j0, j1, n_blocks = list_part(idx_ptr, t, idx_stride, sp, split_len, topk, BLOCK_N, TRIM, TRIM_LEN, WG)

    gl.warp_specialize(
        [
            (_softmax_wg, (q_smem, qpe_smem, c_smem, pe_smem, p_smem, alpha_smem, l_smem, full, empty, p_full, p_empty,
                           l_full, idx_ptr, o_ptr, lse_ptr, t, sp, h0, heads, idx_stride, num_splits, j0, j1, n_blocks,
                           scale_log2, q_lat_ptr, q_pe_ptr, R, P, SPLIT, Q_HERE)),
            (_pv_wg, (c_smem, p_smem, alpha_smem, l_smem, empty, p_full, p_empty, l_full, o_ptr, lse_ptr, t, sp, h0,
                      heads, num_splits, n_blocks, R, SPLIT)),
            (_producer, (c_smem, pe_smem, full, empty, cache_ptr, cache_f32_ptr, cache_bf16_ptr, idx_ptr, t,
                         idx_stride, j0, j1, n_blocks, R, P, G, ROW_BYTES, FP8, BITS)),
        ],
        [WG, WG],
        [PV_REGS, PRODUCER_REGS],
    )  # fmt: skip


def takes_shapes(heads: int, rank: int, rope: int, q_dtype, pe_dtype, cache_dtype) -> bool:
    """bf16 queries, whole blocks of 64 heads, a latent rank of 512 (two 256-column halves, four FP8
    groups of 128), a rope part of 64, an FP8 (uint8 rows) or bf16 cache."""
    return (
        q_dtype == torch.bfloat16
        and pe_dtype == torch.bfloat16
        and cache_dtype in (torch.uint8, torch.bfloat16)
        and heads % BLOCK_H.value == 0
        and rank == 512
        and rope == 64
    )


def supports(q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor) -> bool:
    """Whether this kernel takes the call: a Hopper GPU and the shapes of takes_shapes."""
    if not q_lat.is_cuda or torch.cuda.get_device_capability(q_lat.device)[0] != 9:
        return False
    return takes_shapes(q_lat.shape[1], q_lat.shape[2], q_pe.shape[2], q_lat.dtype, q_pe.dtype, latent_cache.dtype)


def sparse_mla_decode_ws(
    q_lat: torch.Tensor,  # bf16 [T, H, R]
    q_pe: torch.Tensor,  # bf16 [T, H, P]
    latent_cache: torch.Tensor,  # [slots, R + P] bf16, or uint8 [..., R + 4 R/G + 2 P]
    indices: torch.Tensor,  # int [T, K]: physical slots, -1 for none
    softmax_scale: float,
    num_splits: int | None = None,
    trim: bool = False,
    out_dtype: torch.dtype = torch.float32,
    bits: bool | None = None,
    q_here: bool | None = None,
    work=None,
    rows=None,
) -> torch.Tensor:
    """-> o_lat [T, H, R] in out_dtype; the arguments as gluon_sparse_mla.sparse_mla_decode_gluon's.
    Device-only (no host sync): CUDA-graph capturable. q_here (default Q_IN_PARTITION): where q
    comes into shared memory. bits (default FP8_DEQUANT_BITS): FP8 codes dequantised by bit
    operations (exact for power-of-two scales) rather than through float32."""
    tokens, heads, rank = q_lat.shape
    out = torch.empty(tokens, heads, rank, dtype=out_dtype, device=q_lat.device)
    if tokens == 0:
        return out
    rope, topk = q_pe.shape[2], indices.shape[1]
    fp8, row_bytes, cache, f32_view, bf16_view = cache_views(latent_cache)
    head_blocks = triton.cdiv(heads, BLOCK_H.value)
    num_splits, split_len, o_part, lse, grid = plan_launch(out, head_blocks, topk, BLOCK_N.value, num_splits, work)
    rows = None if work is not None else rows
    split, trim = num_splits > 1, trim and work is None and rows is None
    idx = indices.contiguous()
    _sparse_mla_ws_kernel[grid](
        q_lat.contiguous(), q_pe.contiguous(), cache, f32_view, bf16_view, idx, o_part, lse,
        plan_pointer(idx, work, rows),
        heads, topk, topk, num_splits, softmax_scale * 1.4426950408889634, split_len,
        R=rank, P=rope, G=min(128, rank), ROW_BYTES=row_bytes, FP8=fp8, SPLIT=split,
        TRIM=trim, TRIM_LEN=max(TRIM_SCAN, triton.next_power_of_2(split_len)),
        BITS=FP8_DEQUANT_BITS if bits is None else bits, Q_HERE=Q_IN_PARTITION if q_here is None else q_here,
        WORK=work is not None, ORDER=rows is not None, num_warps=WG.value,
    )  # fmt: skip
    if split:
        combine_splits(o_part, lse, out, None if work is None else work.counts)
    return out
