"""Sparse MLA in Gluon (Triton's explicit-layout dialect), Hopper only: decode steps, and prompt
chunks launched the same way without splits.

Same math and outputs as triton_sparse_mla.sparse_mla_decode (and so sparse_mla.sparse_mla_torch):
    s[t, h, j] = scale * (q_lat[t, h] . c[slot_tj] + q_pe[t, h] . k_pe[slot_tj]),  o = softmax(s) @ c

Why a second kernel: with tl.dot, Triton gives a product whose result feeds another product all
8 warps along M, so with 64 heads (M = 64) both warpgroups compute the same QK^T tile: half the
tensor-core work and ~430 KB of shared-memory operand reads per 64 rows are spent twice
(bench/kernels/NOTES.md, sparse MLA). Here the layouts are chosen by hand, as FlashMLA does:
- QK^T: the two warpgroups split the block's keys (warps [4, 2]); each computes 64 heads x
  BLOCK_N / 2 keys from q (resident in shared memory) and its half of the gathered rows.
- softmax: the row max and sum combine across the two warpgroups.
- PV: P (64 x BLOCK_N, bf16, through shared memory to both warpgroups) times the same rows,
  which the warpgroups split by output columns (256 of the 512 each).

Pipeline (two buffers of rows in shared memory): block i+1's rows are gathered while block i's
QK^T, softmax and PV run (EARLY_GATHER: a bf16 cache by cp.async; an FP8 cache's stored bytes by
cp.async into the same buffer, then dequantised in shared memory by the warps after issuing block
i's PV: FP8_STAGE). The copies are issued at the top of block i, once block i-1's PV (the last
reader of their buffer) is done, from slots the warps read from a small ring of index blocks in
shared memory, loaded two blocks ahead. Indices are physical slots, -1 for none (masked, never
read).

Gluon has no CPU interpreter: the CPU path (and every shape this kernel does not take) stays on
the Triton kernel; the GPU tests compare the two and the torch reference.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from .triton_sparse_mla import TRIM_SCAN, cache_views, combine_splits, plan_launch, plan_pointer

BLOCK_H = gl.constexpr(64)  # heads per program: the MMA's M, one warpgroup's 4 x 16 rows
NUM_WARPS = gl.constexpr(8)  # two warpgroups
# FP8 cache: stage the next block's rows in shared memory by cp.async (issued before the softmax)
# rather than load them into registers after the PV issue, where their gather latency sat in each
# block's critical path. Same operands bit for bit. Measured on the H200 at GLM-5 shapes
# (bench/results/2026-12-02-gluon-sparse-mla-fp8-staged): decode 84.8 against 90.7 us at 64 tokens,
# 282 / 306 at 256, 1098 / 1169 at 1024; 2048-token prompt chunks 2206 / 2399 (causal 1244 / 1369);
# in the model's graph-replayed decode step the sparse MLA family 1.78 against 1.95-1.98 ms at 256
# rows, 6.97 against 7.56-7.70 at 1024. False restores the register path (for A/B runs).
FP8_STAGE = True
# Issue block i + 1's copies before block i's QK^T (the kernel's EARLY) rather than after its wait,
# with their slots from a shared-memory ring of index blocks loaded two blocks ahead, so that no copy
# issue waits for an index load. Same operands bit for bit. Measured on the H200 at GLM-5 shapes
# (bench/results/2026-12-03-gluon-sparse-mla-early-copies): FP8 decode 76.9 against 84.2 us at 64
# tokens, 261 / 280 at 256, 1021 / 1097 at 1024; bf16 75.7 / 82.7, 245 / 261, 961 / 1006; in the
# model's graph-replayed decode step at 256 x 1400 the sparse MLA 1.77 against 1.84 ms. (Slots held
# in registers instead cost the FP8 path's dequantisation its registers: 15% slower there.)
# False restores the late issue (for A/B runs).
EARLY_GATHER = True
# FP8 cache: dequantise through float32 rather than by bit operations and two exact bf16 multiplies
# (_E4M3_BF16_ASM, exact for the cache's power-of-two scales, kv_cache_format). Here, where the
# dequantisation shares the warps with the MMAs and the softmax, the bit form measured 2% slower
# at 64 tokens and the same from 128 (bench/results/2026-12-04-gluon-sparse-mla-fp8-bits-r1, -r2);
# the warp-specialised kernel, whose producer it bounds, takes it (its FP8_DEQUANT_BITS).
FP8_DEQUANT_BITS = False


@gluon.jit
def _load_slots(idx_ptr, t, idx_stride, j, j1, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """(valid, slot) of entries j .. j + BLOCK_N of token t's list in `layout` (1-D): entries past
    j1 and -1 entries are invalid and read as slot 0 under a mask."""
    offs = j + gl.arange(0, BLOCK_N, layout=layout)
    idx = gl.load(idx_ptr + t.to(gl.int64) * idx_stride + offs, mask=offs < j1, other=-1)
    valid = idx >= 0
    return valid, gl.where(valid, idx, 0).to(gl.int64)


@gluon.constexpr_function
def _pe_layout(P):
    """k_pe rows [rows, P]: 8 consecutive values a thread."""
    return gl.BlockedLayout([1, 8], [32 // (P // 8), P // 8], [NUM_WARPS, 1], [1, 0])


# bf16 latent rows [rows, R]: 8 consecutive values a thread, a row over a warp.
_ROWS_L = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [NUM_WARPS, 1], [1, 0]))


@gluon.jit
def _gather_pe_at(pe_buf, ptr, valid, slot, ROW: gl.constexpr, AT: gl.constexpr, P: gl.constexpr):
    """cp.async the rows' bf16 k_pe (P values at element AT of rows of ROW bf16 elements from ptr: the
    bf16 row's tail, or the FP8 row's after its codes and scales) into pe_buf [BLOCK_N, P]; (valid,
    slot) in _pe_layout's row slice."""
    offs_p = gl.arange(0, P, layout=gl.SliceLayout(0, _pe_layout(P)))
    async_copy.async_copy_global_to_shared(
        pe_buf, ptr + slot[:, None] * ROW + AT + offs_p[None, :], mask=valid[:, None]
    )


@gluon.jit
def _gather_pe(pe_buf, ptr, idx_ptr, t, idx_stride, j, j1,
               ROW: gl.constexpr, AT: gl.constexpr, P: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """_gather_pe_at for list entries j .. j + BLOCK_N (their slots loaded here)."""
    valid, slot = _load_slots(idx_ptr, t, idx_stride, j, j1, BLOCK_N, gl.SliceLayout(1, _pe_layout(P)))
    _gather_pe_at(pe_buf, ptr, valid, slot, ROW, AT, P)


@gluon.jit
def _gather_bf16_at(c_buf, pe_buf, cache_ptr, valid_r, slot_r, valid_p, slot_p, R: gl.constexpr, P: gl.constexpr):
    """cp.async rows (c | k_pe, model dtype) into c_buf [BLOCK_N, R] and pe_buf [BLOCK_N, P]; the
    slots in _ROWS_L's and _pe_layout's row slices."""
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, _ROWS_L))
    row = cache_ptr + slot_r[:, None] * (R + P)
    async_copy.async_copy_global_to_shared(c_buf, row + offs_r[None, :], mask=valid_r[:, None])
    _gather_pe_at(pe_buf, cache_ptr, valid_p, slot_p, R + P, R, P)


@gluon.jit
def _gather_bf16(c_buf, pe_buf, cache_ptr, idx_ptr, t, idx_stride, j, j1,
                 R: gl.constexpr, P: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """_gather_bf16_at for list entries j .. j + BLOCK_N (their slots loaded here)."""
    valid_r, slot_r = _load_slots(idx_ptr, t, idx_stride, j, j1, BLOCK_N, gl.SliceLayout(1, _ROWS_L))
    valid_p, slot_p = _load_slots(idx_ptr, t, idx_stride, j, j1, BLOCK_N, gl.SliceLayout(1, _pe_layout(P)))
    _gather_bf16_at(c_buf, pe_buf, cache_ptr, valid_r, slot_r, valid_p, slot_p, R, P)


@gluon.constexpr_function
def _codes_layout(R, G):
    """An FP8 block's codes as [rows, R / G, G]: 16 consecutive codes a thread, a row's groups
    spread over a warp's lanes."""
    return gl.BlockedLayout([1, 1, 16], [1, R // G, 32 // (R // G)], [NUM_WARPS, 1, 1], [2, 1, 0])


@gluon.jit
def _fp8_code_ptrs_at(cache_ptr, slot, R: gl.constexpr, G: gl.constexpr, ROW_BYTES: gl.constexpr):
    """(pointers to the codes [ROWS, R / G, G] of rows `slot` (in _codes_layout's row slice),
    group offsets [R / G])."""
    codes_l: gl.constexpr = _codes_layout(R, G)
    sc_l: gl.constexpr = gl.SliceLayout(2, codes_l)
    offs_g = gl.arange(0, R // G, layout=gl.SliceLayout(0, sc_l))
    offs_e = gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(1, codes_l)))
    at = slot[:, None] * ROW_BYTES + offs_g[None, :] * G  # [ROWS, R / G]
    return cache_ptr + at[:, :, None] + offs_e[None, None, :], offs_g


@gluon.jit
def _fp8_code_ptrs(cache_ptr, idx_ptr, t, idx_stride, j, j1,
                   R: gl.constexpr, G: gl.constexpr, ROW_BYTES: gl.constexpr, ROWS: gl.constexpr):  # fmt: skip
    """(pointers to the codes [ROWS, R / G, G] of list entries j .. j + ROWS in _codes_layout, valid
    [ROWS], slot [ROWS], group offsets [R / G]); invalid entries point at slot 0."""
    codes_l: gl.constexpr = _codes_layout(R, G)
    valid, slot = _load_slots(idx_ptr, t, idx_stride, j, j1, ROWS, gl.SliceLayout(1, gl.SliceLayout(2, codes_l)))
    ptrs, offs_g = _fp8_code_ptrs_at(cache_ptr, slot, R, G, ROW_BYTES)
    return ptrs, valid, slot, offs_g


@gluon.jit
def _load_fp8_codes(cache_ptr, cache_f32_ptr, idx_ptr, t, idx_stride, j, j1,
                    R: gl.constexpr, G: gl.constexpr, ROW_BYTES: gl.constexpr, ROWS: gl.constexpr):  # fmt: skip
    """The e4m3 codes [ROWS, R / G, G] and group scales [ROWS, R / G] of list entries j .. j + ROWS,
    in registers (loads issued; their latency is paid where the values are first used)."""
    ptrs, valid, slot, offs_g = _fp8_code_ptrs(cache_ptr, idx_ptr, t, idx_stride, j, j1, R, G, ROW_BYTES, ROWS)
    codes = gl.load(ptrs, mask=valid[:, None, None], other=0)
    sc = gl.load(
        cache_f32_ptr + slot[:, None] * (ROW_BYTES // 4) + R // 4 + offs_g[None, :], mask=valid[:, None], other=0.0
    )
    return codes, sc


# Four e4m3 codes ($2, one byte each) to four bf16 values ($0, $1: two a register), times the group's
# scale ($3: bf16 pairs). Each pair of codes becomes a pair of bf16 bit patterns by one byte permute
# (a code in the low byte of its 16-bit half, its sign replicated over the high byte), a shift by
# 4 and a mask: sign at bit 15, the code's 4 exponent and 3 mantissa bits at bits 4-10. Read as bf16
# that is the code's value times 2^-120, subnormal codes (and zero) included, so one multiply by
# 2^120 (0x7B80) makes it exact, and a second by the power-of-two scale is exact as well: the same
# bits as code -> float32 x scale -> bf16, in 5 integer / bf16x2 instructions a pair instead of the
# conversion chain's 6, two of them on the slow conversion unit. NaN codes (0x7F, 0xFF; the cache
# quantiser never writes them) would read as +-480.
_E4M3_BF16_ASM = gl.constexpr("""{
.reg .b32 lo, hi, k;
mov.b32 k, 0x7B807B80;
prmt.b32 lo, $2, 0, 0x9180;
prmt.b32 hi, $2, 0, 0xB3A2;
shl.b32 lo, lo, 4;
shl.b32 hi, hi, 4;
and.b32 lo, lo, 0x87F087F0;
and.b32 hi, hi, 0x87F087F0;
mul.rn.bf16x2 lo, lo, k;
mul.rn.bf16x2 hi, hi, k;
mul.rn.bf16x2 $0, lo, $3;
mul.rn.bf16x2 $1, hi, $3;
}""")


@gluon.jit
def _store_fp8_rows(c_buf, codes, sc, row0, R: gl.constexpr, ROWS: gl.constexpr, BITS: gl.constexpr):
    """Dequantise (code x group scale, rounded to bf16, as the Triton kernel and the torch reference
    do) into rows row0 .. row0 + ROWS of c_buf. BITS: by bit operations (_E4M3_BF16_ASM), exact for
    the cache's power-of-two scales; else through float32 (exact for any scale)."""
    if BITS:
        vals = gl.inline_asm_elementwise(
            _E4M3_BF16_ASM, "=r,=r,r,r,r", [codes, sc.to(gl.bfloat16)[:, :, None]], gl.bfloat16, is_pure=True, pack=4
        )
    else:
        vals = (codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * sc[:, :, None]).to(gl.bfloat16)
    c_buf.slice(row0, ROWS, dim=0).store(gl.reshape(vals, [ROWS, R]))


@gluon.jit
def _fill_fp8(c_buf, pe_buf, cache_ptr, cache_f32_ptr, cache_bf16_ptr, idx_ptr, t, idx_stride, j, j1,
              R: gl.constexpr, P: gl.constexpr, G: gl.constexpr, ROW_BYTES: gl.constexpr, BLOCK_N: gl.constexpr,
              BITS: gl.constexpr):  # fmt: skip
    """A block of FP8 rows into c_buf (dequantised, bf16) and pe_buf (cp.async). All loads are issued
    before the first use, and the block is dequantised a quarter at a time: the float32 values of a
    whole block (128 registers a thread) next to the accumulator would spill."""
    Q: gl.constexpr = BLOCK_N // 4
    _gather_pe(
        pe_buf, cache_bf16_ptr, idx_ptr, t, idx_stride, j, j1, ROW_BYTES // 2, (R + 4 * (R // G)) // 2, P, BLOCK_N
    )
    c0, s0 = _load_fp8_codes(cache_ptr, cache_f32_ptr, idx_ptr, t, idx_stride, j, j1, R, G, ROW_BYTES, Q)
    c1, s1 = _load_fp8_codes(cache_ptr, cache_f32_ptr, idx_ptr, t, idx_stride, j + Q, j1, R, G, ROW_BYTES, Q)
    c2, s2 = _load_fp8_codes(cache_ptr, cache_f32_ptr, idx_ptr, t, idx_stride, j + 2 * Q, j1, R, G, ROW_BYTES, Q)
    c3, s3 = _load_fp8_codes(cache_ptr, cache_f32_ptr, idx_ptr, t, idx_stride, j + 3 * Q, j1, R, G, ROW_BYTES, Q)
    _store_fp8_rows(c_buf, c0, s0, 0, R, Q, BITS)
    _store_fp8_rows(c_buf, c1, s1, Q, R, Q, BITS)
    _store_fp8_rows(c_buf, c2, s2, 2 * Q, R, Q, BITS)
    _store_fp8_rows(c_buf, c3, s3, 3 * Q, R, Q, BITS)


@gluon.constexpr_function
def _stage_scales_layout(R, G):
    """An FP8 block's group scales [rows, R / G] as _stage_fp8 copies them: a row a thread."""
    return gl.BlockedLayout([1, R // G], [32, 1], [NUM_WARPS, 1], [1, 0])


@gluon.jit
def _stage_fp8_at(stage_buf, sc_buf, pe_buf, cache_ptr, cache_f32_ptr, cache_bf16_ptr, slots,
                  R: gl.constexpr, P: gl.constexpr, G: gl.constexpr, ROW_BYTES: gl.constexpr):  # fmt: skip
    """_stage_fp8 with the rows' slots already loaded: slots as _fp8_block_slots returns them."""
    valid_p, slot_p, valid_c, slot_c, valid_s, slot_s = slots
    _gather_pe_at(pe_buf, cache_bf16_ptr, valid_p, slot_p, ROW_BYTES // 2, (R + 4 * (R // G)) // 2, P)
    ptrs, _ = _fp8_code_ptrs_at(cache_ptr, slot_c, R, G, ROW_BYTES)
    async_copy.async_copy_global_to_shared(stage_buf, ptrs, mask=valid_c[:, None, None])
    offs_sg = gl.arange(0, R // G, layout=gl.SliceLayout(0, _stage_scales_layout(R, G)))
    async_copy.async_copy_global_to_shared(
        sc_buf, cache_f32_ptr + slot_s[:, None] * (ROW_BYTES // 4) + R // 4 + offs_sg[None, :], mask=valid_s[:, None]
    )


@gluon.jit
def _fp8_block_slots(idx_ptr, t, idx_stride, j, j1, R: gl.constexpr, P: gl.constexpr, G: gl.constexpr,
                     BLOCK_N: gl.constexpr):  # fmt: skip
    """(valid, slot) of list entries j .. j + BLOCK_N in each layout _stage_fp8_at copies with: k_pe,
    codes, scales."""
    valid_p, slot_p = _load_slots(idx_ptr, t, idx_stride, j, j1, BLOCK_N, gl.SliceLayout(1, _pe_layout(P)))
    codes_row: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, _codes_layout(R, G)))
    valid_c, slot_c = _load_slots(idx_ptr, t, idx_stride, j, j1, BLOCK_N, codes_row)
    valid_s, slot_s = _load_slots(idx_ptr, t, idx_stride, j, j1, BLOCK_N, gl.SliceLayout(1, _stage_scales_layout(R, G)))
    return valid_p, slot_p, valid_c, slot_c, valid_s, slot_s


@gluon.jit
def _smem_slots(idx_buf, layout: gl.constexpr):
    """(valid, slot) of a block's list entries from idx_buf ([BLOCK_N] int32 in shared memory, -1 for
    none) in `layout` (1-D): -1 entries are invalid and read as slot 0 under a mask."""
    idx = idx_buf.load(layout)
    valid = idx >= 0
    return valid, gl.where(valid, idx, 0).to(gl.int64)


@gluon.jit
def _fp8_smem_slots(idx_buf, R: gl.constexpr, P: gl.constexpr, G: gl.constexpr):
    """_fp8_block_slots from a shared-memory index buffer (_smem_slots)."""
    valid_p, slot_p = _smem_slots(idx_buf, gl.SliceLayout(1, _pe_layout(P)))
    valid_c, slot_c = _smem_slots(idx_buf, gl.SliceLayout(1, gl.SliceLayout(2, _codes_layout(R, G))))
    valid_s, slot_s = _smem_slots(idx_buf, gl.SliceLayout(1, _stage_scales_layout(R, G)))
    return valid_p, slot_p, valid_c, slot_c, valid_s, slot_s


@gluon.jit
def _stage_fp8(stage_buf, sc_buf, pe_buf, cache_ptr, cache_f32_ptr, cache_bf16_ptr, idx_ptr, t, idx_stride, j, j1,
               R: gl.constexpr, P: gl.constexpr, G: gl.constexpr, ROW_BYTES: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """STAGE: cp.async a block of FP8 rows as they are stored: the codes into stage_buf [BLOCK_N,
    R / G, G] (uint8), the group scales into sc_buf [BLOCK_N, R / G] (float32), k_pe into pe_buf.
    Nothing waits here: the copies land while the current block's softmax and PV run, and
    _unstage_fp8 dequantises from shared memory (no global latency in its path)."""
    slots = _fp8_block_slots(idx_ptr, t, idx_stride, j, j1, R, P, G, BLOCK_N)
    _stage_fp8_at(stage_buf, sc_buf, pe_buf, cache_ptr, cache_f32_ptr, cache_bf16_ptr, slots, R, P, G, ROW_BYTES)


@gluon.jit
def _unstage_fp8(c_buf, stage_buf, sc_buf, R: gl.constexpr, G: gl.constexpr, BLOCK_N: gl.constexpr, BITS: gl.constexpr):
    """Dequantise a staged block (_stage_fp8, landed and visible) into c_buf, which holds the
    staging bytes themselves: every thread first reads all of its codes and scales (as bytes and
    float32: the float32 values of a whole block would spill, as in _fill_fp8), then, after a
    barrier, the bf16 rows overwrite them a quarter of the block at a time."""
    Q: gl.constexpr = BLOCK_N // 4
    codes_l: gl.constexpr = _codes_layout(R, G)
    sc_l: gl.constexpr = gl.SliceLayout(2, codes_l)
    c0 = stage_buf.slice(0, Q, dim=0).load(codes_l)
    c1 = stage_buf.slice(Q, Q, dim=0).load(codes_l)
    c2 = stage_buf.slice(2 * Q, Q, dim=0).load(codes_l)
    c3 = stage_buf.slice(3 * Q, Q, dim=0).load(codes_l)
    s0 = sc_buf.slice(0, Q, dim=0).load(sc_l)
    s1 = sc_buf.slice(Q, Q, dim=0).load(sc_l)
    s2 = sc_buf.slice(2 * Q, Q, dim=0).load(sc_l)
    s3 = sc_buf.slice(3 * Q, Q, dim=0).load(sc_l)
    gl.thread_barrier()
    _store_fp8_rows(c_buf, c0, s0, 0, R, Q, BITS)
    _store_fp8_rows(c_buf, c1, s1, Q, R, Q, BITS)
    _store_fp8_rows(c_buf, c2, s2, 2 * Q, R, Q, BITS)
    _store_fp8_rows(c_buf, c3, s3, 3 * Q, R, Q, BITS)


@gluon.jit
def _softmax_pv(s, valid, m_i, l_i, acc, c_buf, scale_log2, o_l: gl.constexpr, p_l: gl.constexpr):
    """One block's online softmax (scores s of the block's valid entries, base 2) and the issue of its
    PV into acc (asynchronous: waited for later) -> (m_i, l_i, acc)."""
    s = gl.where(valid[None, :], s * scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_l)
    return m_new, l_i, warpgroup_mma(p_op, c_buf, acc, is_async=True)


@gluon.jit
def list_part(idx_ptr, t, idx_stride, sp, split_len, topk, BLOCK_N: gl.constexpr, TRIM: gl.constexpr,
              TRIM_LEN: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
    """(j0, j1, blocks) of split sp of token t's list: entries j0 .. j1, in BLOCK_N blocks. TRIM:
    the blocks end at the part's last valid entry (a decode graph's lists are as wide as its
    context bucket, -1 padded)."""
    j0 = sp * split_len
    j1 = gl.minimum(j0 + split_len, topk)
    span = split_len
    if TRIM:
        trim_l: gl.constexpr = gl.BlockedLayout([TRIM_LEN // (32 * WARPS)], [32], [WARPS], [0])
        offs_all = j0 + gl.arange(0, TRIM_LEN, layout=trim_l)
        row = gl.load(idx_ptr + t.to(gl.int64) * idx_stride + offs_all, mask=offs_all < j1, other=-1)
        span = gl.max(gl.where(row >= 0, offs_all - j0 + 1, 0), axis=0)
    return j0, j1, gl.cdiv(span, BLOCK_N)


@gluon.jit
def work_part(work_ptr, BLOCK_N: gl.constexpr):
    """This program's entry of a work plan (mla_work.MlaWork.parts): (row, part, j0, j1, blocks);
    row -1 for a spare program."""
    wp = work_ptr + gl.program_id(0) * 4
    j0 = gl.load(wp + 2)
    j1 = gl.load(wp + 3)
    return gl.load(wp), gl.load(wp + 1), j0, j1, gl.cdiv(j1 - j0, BLOCK_N)


@gluon.jit
def ordered_part(order_ptr, split_len, topk, BLOCK_N: gl.constexpr):
    """This program's row of the step's row order (mla_rows.RowOrder.rows: (row, valid entries),
    longest first) and its split: (row, split, j0, j1, blocks), the blocks ending at the row's
    last valid entry (none for a split past it)."""
    op = order_ptr + gl.program_id(0) * 2
    sp = gl.program_id(1)
    j0 = sp * split_len
    j1 = gl.minimum(gl.minimum(j0 + split_len, topk), gl.load(op + 1))
    return gl.load(op), sp, j0, j1, gl.cdiv(gl.maximum(j1 - j0, 0), BLOCK_N)


# The list length and its split are runtime values (not specialised), as in the Triton kernel.
@gluon.jit(do_not_specialize=["topk", "split_len"])
def _sparse_mla_gluon_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, cache_f32_ptr, cache_bf16_ptr, idx_ptr, o_ptr, lse_ptr, work_ptr,
    heads, topk, idx_stride, num_splits, scale_log2, split_len,
    R: gl.constexpr, P: gl.constexpr, G: gl.constexpr, ROW_BYTES: gl.constexpr, BLOCK_N: gl.constexpr,
    FP8: gl.constexpr, SPLIT: gl.constexpr, TRIM: gl.constexpr, TRIM_LEN: gl.constexpr, STAGE: gl.constexpr = False,
    EARLY: gl.constexpr = False, BITS: gl.constexpr = False, WORK: gl.constexpr = False,
    ORDER: gl.constexpr = False,
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

    # S [BLOCK_H, BLOCK_N]: the warpgroups split the keys. O [BLOCK_H, R]: they split the columns.
    s_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, R // 2, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    q_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    pe_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * P), element_bitwidth=16, rank=2)
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NUM_WARPS, 1], [1, 0])
    qpe_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (P // 8), P // 8], [NUM_WARPS, 1], [1, 0])

    # q (this program's heads, zero rows past `heads`) stays in shared memory for every block.
    offs_qh = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_l))
    q_rows = (t * heads + offs_qh).to(gl.int64)
    offs_qr = gl.arange(0, R, layout=gl.SliceLayout(0, q_l))
    q_lat = gl.load(q_lat_ptr + q_rows[:, None] * R + offs_qr[None, :], mask=(offs_qh < heads)[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, R], q_sl, q_lat)
    offs_ph = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, qpe_l))
    offs_pp = gl.arange(0, P, layout=gl.SliceLayout(0, qpe_l))
    q_pe = gl.load(
        q_pe_ptr + (t * heads + offs_ph).to(gl.int64)[:, None] * P + offs_pp[None, :],
        mask=(offs_ph < heads)[:, None],
        other=0.0,
    )
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, P], pe_sl, q_pe)
    c_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, R], q_sl)
    pe_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, P], pe_sl)
    if FP8 and STAGE:
        # The staged codes live in the bf16 buffer they are dequantised into (half of its bytes,
        # plain row-major); the scales in a small buffer of their own (2 KB at 64 rows).
        plain3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
        sc_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, R // G], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))

    if not (WORK or ORDER):
        j0, j1, n_blocks = list_part(idx_ptr, t, idx_stride, sp, split_len, topk, BLOCK_N, TRIM, TRIM_LEN, NUM_WARPS)

    # Block 0 into buffer 0.
    if FP8:
        _fill_fp8(c_smem.index(0), pe_smem.index(0), cache_ptr, cache_f32_ptr, cache_bf16_ptr, idx_ptr, t, idx_stride, j0, j1,
                  R, P, G, ROW_BYTES, BLOCK_N, BITS)  # fmt: skip
    else:
        _gather_bf16(c_smem.index(0), pe_smem.index(0), cache_ptr, idx_ptr, t, idx_stride, j0, j1, R, P, BLOCK_N)
    async_copy.commit_group()

    m_i = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_l))  # finite: an all-masked block adds 0
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, s_l))
    # Carried as an in-flight MMA accumulator: each block's PV is waited for under the next QK^T.
    acc = warpgroup_mma_init(gl.zeros([BLOCK_H, R], gl.float32, layout=o_l))
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_l)
    if EARLY:
        gl.static_assert(STAGE or not FP8, "the early copies of an FP8 cache are staged (STAGE)")
        # Block i + 1's copies are issued before block i's QK^T (after block i - 1's PV, the last
        # reader of their buffer, is waited for), so they have the QK^T, the softmax and the PV
        # issue to land in. Their slots come from a ring of index blocks in shared memory, loaded
        # two blocks ahead (held in registers, the loads would cost the unstaging its registers;
        # loaded where used, each copy issue would wait for them).
        IDX_L: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        idx_smem = gl.allocate_shared_memory(gl.int32, [4, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        offs_idx = gl.arange(0, BLOCK_N, layout=IDX_L)
        idx_row = idx_ptr + t.to(gl.int64) * idx_stride
        idx_smem.index(0).store(gl.load(idx_row + j0 + offs_idx, mask=j0 + offs_idx < j1, other=-1).to(gl.int32))
        j_ = j0 + BLOCK_N + offs_idx
        idx_smem.index(1).store(gl.load(idx_row + j_, mask=j_ < j1, other=-1).to(gl.int32))
        for i in range(n_blocks):
            buf = i % 2
            nxt = 1 - buf
            j = j0 + i * BLOCK_N
            # Block i - 1's PV has read buffer `nxt` (this warpgroup's; the barrier covers both),
            # block i's rows are in buffer `buf`, landed and fenced for the MMA's async proxy, and
            # the index blocks stored last iteration are visible.
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            async_copy.wait_group(0)
            fence_async_shared()
            gl.thread_barrier()
            if FP8:
                stage = c_smem.index(nxt)._reinterpret(gl.uint8, [2 * BLOCK_N, R // G, G], plain3).slice(0, BLOCK_N)
                _stage_fp8_at(stage, sc_smem.index(nxt), pe_smem.index(nxt), cache_ptr, cache_f32_ptr, cache_bf16_ptr,
                              _fp8_smem_slots(idx_smem.index((i + 1) % 4), R, P, G), R, P, G, ROW_BYTES)  # fmt: skip
            else:
                vr, sr = _smem_slots(idx_smem.index((i + 1) % 4), gl.SliceLayout(1, _ROWS_L))
                vp, sp_ = _smem_slots(idx_smem.index((i + 1) % 4), gl.SliceLayout(1, _pe_layout(P)))
                _gather_bf16_at(c_smem.index(nxt), pe_smem.index(nxt), cache_ptr, vr, sr, vp, sp_, R, P)
            async_copy.commit_group()
            # Block i + 2's indices: loaded now, stored into the ring at the end of the iteration.
            j_ = j + 2 * BLOCK_N + offs_idx
            idx_ahead = gl.load(idx_row + j_, mask=j_ < j1, other=-1).to(gl.int32)
            c_buf = c_smem.index(buf)
            pe_buf = pe_smem.index(buf)
            s = warpgroup_mma(q_smem, c_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(qpe_smem, pe_buf.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            valid = idx_smem.index(i % 4).load(gl.SliceLayout(0, s_l)) >= 0
            m_i, l_i, acc = _softmax_pv(s, valid, m_i, l_i, acc, c_buf, scale_log2, o_l, p_l)
            if FP8:
                async_copy.wait_group(0)
                gl.thread_barrier()  # every thread's staged copies have landed
                _unstage_fp8(c_smem.index(nxt), stage, sc_smem.index(nxt), R, G, BLOCK_N, BITS)
            idx_smem.index((i + 2) % 4).store(idx_ahead)
    else:
        for i in range(n_blocks):
            buf = i % 2
            j = j0 + i * BLOCK_N
            # Block i's rows are in buffer `buf` once every thread's copies and stores have landed and
            # are fenced for the async proxy the MMA reads shared memory through.
            async_copy.wait_group(0)
            fence_async_shared()
            gl.thread_barrier()
            c_buf = c_smem.index(buf)
            pe_buf = pe_smem.index(buf)
            s = warpgroup_mma(q_smem, c_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(qpe_smem, pe_buf.permute((1, 0)), s, is_async=True)
            # Also waits for block i - 1's PV, the last reader of the other buffer ...
            s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc))
            # ... in both warpgroups, before block i + 1 is written into it.
            gl.thread_barrier()
            nxt = 1 - buf
            if FP8 and STAGE:
                stage = c_smem.index(nxt)._reinterpret(gl.uint8, [2 * BLOCK_N, R // G, G], plain3).slice(0, BLOCK_N)
                _stage_fp8(stage, sc_smem.index(nxt), pe_smem.index(nxt), cache_ptr, cache_f32_ptr, cache_bf16_ptr,
                           idx_ptr, t, idx_stride, j + BLOCK_N, j1, R, P, G, ROW_BYTES, BLOCK_N)  # fmt: skip
                async_copy.commit_group()
            if not FP8:
                # The copies run while this block's softmax and PV do.
                _gather_bf16(
                    c_smem.index(nxt), pe_smem.index(nxt), cache_ptr, idx_ptr, t, idx_stride, j + BLOCK_N, j1, R, P, BLOCK_N
                )
                async_copy.commit_group()

            valid, _ = _load_slots(idx_ptr, t, idx_stride, j, j1, BLOCK_N, gl.SliceLayout(0, s_l))
            m_i, l_i, acc = _softmax_pv(s, valid, m_i, l_i, acc, c_buf, scale_log2, o_l, p_l)
            if FP8 and STAGE:
                async_copy.wait_group(0)
                gl.thread_barrier()  # every thread's staged copies have landed
                _unstage_fp8(c_smem.index(nxt), stage, sc_smem.index(nxt), R, G, BLOCK_N, BITS)
            elif FP8:
                # Dequantised by the warps themselves, so after the PV issue: it runs meanwhile. (Codes
                # loaded before the softmax and stored here measured slower at batch >= 256: 317
                # against 294 us at 256, bench/results/2026-12-02-gluon-sparse-mla-v2.)
                _fill_fp8(c_smem.index(nxt), pe_smem.index(nxt), cache_ptr, cache_f32_ptr, cache_bf16_ptr, idx_ptr, t, idx_stride,
                          j + BLOCK_N, j1, R, P, G, ROW_BYTES, BLOCK_N, BITS)  # fmt: skip
                async_copy.commit_group()
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_l))
    has = l_o > 0.0
    out = acc / gl.where(has, l_o, 1.0)[:, None]
    offs_h = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_l))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, o_l))
    hmask = offs_h < heads
    if SPLIT:
        part = (t * num_splits + sp).to(gl.int64) * heads + offs_h
        gl.store(o_ptr + part[:, None] * R + offs_r[None, :], out, mask=hmask[:, None])
        m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_l))
        gl.store(lse_ptr + part, gl.where(has, m_o + gl.log2(l_o), float("-inf")), mask=hmask)
    else:
        rows = (t * heads + offs_h).to(gl.int64)
        gl.store(o_ptr + rows[:, None] * R + offs_r[None, :], out.to(o_ptr.dtype.element_ty), mask=hmask[:, None])


def supports(q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor) -> bool:
    """Whether this kernel takes the call: a Hopper GPU and the shapes of takes_shapes."""
    if not q_lat.is_cuda or torch.cuda.get_device_capability(q_lat.device)[0] != 9:
        return False
    return takes_shapes(q_lat.shape[1], q_lat.shape[2], q_pe.shape[2], q_lat.dtype, q_pe.dtype, latent_cache.dtype)


def takes_shapes(heads: int, rank: int, rope: int, q_dtype, pe_dtype, cache_dtype) -> bool:
    """bf16 queries; whole blocks of 64 heads (fewer, as under tensor parallelism without
    data-parallel attention, would pad the MMA's M side with zero rows: the Triton kernel takes
    those); a latent rank that splits into two warpgroups' MMA columns and whole FP8 groups of 128,
    in a power-of-two count (128, 256 or 512: the codes' layout spreads the groups over a warp's
    lanes); a rope part of 16 to 64; an FP8 (uint8 rows) or bf16 cache."""
    return (
        q_dtype == torch.bfloat16
        and pe_dtype == torch.bfloat16
        and cache_dtype in (torch.uint8, torch.bfloat16)
        and heads % BLOCK_H.value == 0
        and rank in (128, 256, 512)
        and rope in (16, 32, 64)
    )


def sparse_mla_decode_gluon(
    q_lat: torch.Tensor,  # bf16 [T, H, R]
    q_pe: torch.Tensor,  # bf16 [T, H, P]
    latent_cache: torch.Tensor,  # [slots, R + P] bf16, or uint8 [..., R + 4 R/G + 2 P]
    indices: torch.Tensor,  # int [T, K]: physical slots, -1 for none
    softmax_scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    trim: bool = False,
    out_dtype: torch.dtype = torch.float32,
    stage: bool | None = None,
    early: bool | None = None,
    bits: bool | None = None,
    work=None,
    rows=None,
) -> torch.Tensor:
    """-> o_lat [T, H, R] in out_dtype; the arguments as triton_sparse_mla.sparse_mla_decode's
    (physical slots only; work, the step's plan of parts, and rows, its row order, as there). Device-only (no host sync): CUDA-graph capturable. stage (FP8 cache;
    default FP8_STAGE): the next block's rows come in by cp.async and are dequantised from shared
    memory (_stage_fp8) instead of loaded into registers after the PV issue. early (default
    EARLY_GATHER; with an FP8 cache only when staged): the next block's copies are issued before
    this block's QK^T, from slots kept in a shared-memory ring two blocks ahead (as int32: caches of
    2^31 rows or more take the late issue). bits (default FP8_DEQUANT_BITS): FP8 codes dequantised
    by bit operations (exact for power-of-two scales) rather than through float32."""
    tokens, heads, rank = q_lat.shape
    out = torch.empty(tokens, heads, rank, dtype=out_dtype, device=q_lat.device)
    if tokens == 0:
        return out
    rope, topk = q_pe.shape[2], indices.shape[1]
    fp8, row_bytes, cache, f32_view, bf16_view = cache_views(latent_cache)
    head_blocks = triton.cdiv(heads, BLOCK_H)
    # A single (token, head block) splits its list over every multiprocessor: 32-row blocks keep
    # two of them per split (batch 1: 16.4 against 18.3 us with 64 rows).
    block_n = block_n or (32 if tokens * head_blocks == 1 else 64)
    num_splits, split_len, o_part, lse, grid = plan_launch(out, head_blocks, topk, block_n, num_splits, work)
    rows = None if work is not None else rows
    split, trim = num_splits > 1, trim and work is None and rows is None
    trim_len = max(TRIM_SCAN, triton.next_power_of_2(split_len))
    stage = fp8 and (FP8_STAGE if stage is None else stage)
    early = (EARLY_GATHER if early is None else early) and (stage or not fp8) and latent_cache.shape[0] < 2**31
    idx = indices.contiguous()
    _sparse_mla_gluon_kernel[grid](
        q_lat.contiguous(), q_pe.contiguous(), cache, f32_view, bf16_view, idx, o_part, lse,
        plan_pointer(idx, work, rows),
        heads, topk, topk, num_splits, softmax_scale * 1.4426950408889634, split_len,
        R=rank, P=rope, G=min(128, rank), ROW_BYTES=row_bytes, BLOCK_N=block_n, FP8=fp8, SPLIT=split,
        TRIM=trim, TRIM_LEN=trim_len, STAGE=stage, EARLY=early, BITS=FP8_DEQUANT_BITS if bits is None else bits,
        WORK=work is not None, ORDER=rows is not None, num_warps=NUM_WARPS,
    )  # fmt: skip
    if split:
        combine_splits(o_part, lse, out, None if work is None else work.counts)
    return out
