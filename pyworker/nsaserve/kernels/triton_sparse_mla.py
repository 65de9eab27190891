"""Triton sparse MLA decode over the paged latent cache (absorbed form, one latent KV head).

Same math as sparse_mla.sparse_mla_torch:
    s[t, h, j] = scale * (q_lat[t, h] . c[slot_tj] + q_pe[t, h] . k_pe[slot_tj]),  o = softmax(s) @ c

Shape of the work: every head of a token reads the same selected rows, so one program takes
BLOCK_H heads of one token (the MMA's M side), streams BLOCK_N selected rows at a time (gathered by
slot, so no page-table walk is needed beyond the slot itself), and keeps an online softmax.
The top-k list is split across programs (flash-decoding) when tokens x head blocks alone would
leave multiprocessors idle; a second small kernel merges the partial results by their
log-sum-exp.

Caches: the model dtype [slots, R + P] (c | k_pe), or the fp8 row (R e4m3 codes | R/G fp32 scales
| P bf16 k_pe; FlashMLA's 656 bytes for R = 512, P = 64). FP8 codes are dequantised to bf16 in
registers (code x group scale, in fp32, then rounded) before both products.

Indices are either physical slots (the registry's interface), or, with the slot transform fused,
logical top-k positions p that the kernel maps to kv_slots[token_kv_base[t] + p] itself.

Pipelining: the slots of the next block are loaded one iteration ahead (loop-carried), so Triton's
software pipeliner treats the row gather as a direct load (cp.async into shared memory, num_stages
- 1 blocks ahead) rather than an indirect one. What bounds the kernel on Hopper is read in the
compiled code (bench/kernels/NOTES.md): Triton lays out a product that feeds another product with
all warps along M, so with 64 heads (M = 64) on 8 warps both warpgroups compute the same QK^T
tile, in N = BLOCK_N / 2 instructions whose operands are re-read from shared memory.

Prefill (sparse_mla_prefill, and the registry backend from PREFILL_TOKENS query tokens) is the same
kernel launched without splits, each program's loop ending at the last valid entry of its list
(rows early in a prompt select fewer than top-k keys). The rope part is zero-padded to an MMA-sized
K (>= 16) so small test models run compiled too.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_common import mma_operand
from .triton_rounding import cast


@triton.jit
def _block_slots(idx_ptr, kv_slots_ptr, kv_base, t, idx_stride, offs_n, j1, LOGICAL: tl.constexpr):
    """(valid, physical slot) of the selected rows offs_n of token t (-1 entries and the tail past
    j1 are invalid and read slot 0 under a mask)."""
    idx = tl.load(idx_ptr + t.to(tl.int64) * idx_stride + offs_n, mask=offs_n < j1, other=-1)
    valid = idx >= 0
    if LOGICAL:
        slot = tl.load(kv_slots_ptr + kv_base + idx, mask=valid, other=0)
    else:
        slot = idx
    return valid, tl.where(valid, slot, 0).to(tl.int64)


@triton.jit
def _attend_block(
    q_lat, q_pe, slot, valid, m_i, l_i, acc, cache_ptr, cache_f32_ptr, cache_bf16_ptr,
    scale_log2, offs_r, offs_p, pmask,
    R: tl.constexpr, P: tl.constexpr, G: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, MASK_ALL: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One block of BLOCK_N selected rows: gather, (dequantise), both products, online softmax."""
    if FP8:
        codes = tl.load(cache_ptr + slot[:, None] * ROW_BYTES + offs_r[None, :], mask=valid[:, None], other=0)
        offs_g = tl.arange(0, R // G)
        # -1 entries read slot 0; with MASK_ALL their scale and k_pe loads are masked as well, else
        # every program with -1 entries reads that one row (the causal prefill without trim ran slower
        # than full lists).
        vmask = valid[:, None] if MASK_ALL else tl.full([BLOCK_N, 1], 1, tl.int1)
        sc = tl.load(cache_f32_ptr + slot[:, None] * (ROW_BYTES // 4) + R // 4 + offs_g[None, :], mask=vmask, other=0.0)
        vals = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        vals = tl.reshape(vals, [BLOCK_N, R // G, G]) * sc[:, :, None]
        c = mma_operand(tl.reshape(vals, [BLOCK_N, R]), INTERPRET)
        pe_at = (R + 4 * (R // G)) // 2
        k_pe = tl.load(
            cache_bf16_ptr + slot[:, None] * (ROW_BYTES // 2) + pe_at + offs_p[None, :],
            mask=vmask & pmask[None, :],
            other=0.0,
        )
    else:
        row = slot[:, None] * (R + P)
        vmask = valid[:, None] if MASK_ALL else tl.full([BLOCK_N, 1], 1, tl.int1)
        c = mma_operand(tl.load(cache_ptr + row + offs_r[None, :], mask=valid[:, None], other=0.0), INTERPRET)
        k_pe = tl.load(cache_ptr + row + R + offs_p[None, :], mask=vmask & pmask[None, :], other=0.0)
    s = tl.dot(q_lat, tl.trans(c)) + tl.dot(q_pe, tl.trans(mma_operand(k_pe, INTERPRET)))  # [BLOCK_H, BLOCK_N]
    s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(mma_operand(p, INTERPRET), c)
    return m_new, l_i, acc


# The list length (topk: min(index_topk, longest context)) and its split are runtime values, not
# specialised: as constants they compiled a new variant (1-2 s) for nearly every prefill step
# whose longest context was below index_topk. The same number as the lists' row stride
# (idx_stride) keeps Triton's 16-divisibility specialisation, so the index loads stay vectorised
# where they can be (the sparse prefill measured up to 4% slower without it); two variants at most.
@triton.jit(do_not_specialize=["topk", "split_len"])
def _sparse_mla_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, cache_f32_ptr, cache_bf16_ptr,
    idx_ptr, kv_base_ptr, kv_slots_ptr, o_ptr, lse_ptr, work_ptr,
    heads, topk, idx_stride, num_splits, scale_log2, split_len,
    SPLIT_LEN: tl.constexpr, R: tl.constexpr, P: tl.constexpr, P_PAD: tl.constexpr, G: tl.constexpr,
    ROW_BYTES: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, LOGICAL: tl.constexpr, SPLIT: tl.constexpr, SKIP_EMPTY: tl.constexpr,
    PREFETCH: tl.constexpr, TRIM: tl.constexpr, TRIM_LEN: tl.constexpr, MASK_ALL: tl.constexpr,
    INTERPRET: tl.constexpr, WORK: tl.constexpr = False, ORDER: tl.constexpr = False,
):  # fmt: skip
    """Grid (tokens, splits, head blocks), or with WORK (the step's plan, mla_work.MlaWork.parts)
    (parts, 1, head blocks): program p runs entries [j0, j1) of row t as its part sp. ORDER
    (work_ptr: the step's row order, mla_rows.RowOrder.rows): program p runs split sp of the row
    the order puts p-th, its loop ending at the row's count of valid entries."""
    if WORK:
        wp = work_ptr + tl.program_id(0) * 4
        t = tl.load(wp)
        live = t >= 0  # the plan's spare programs (row -1) loop over nothing and store nothing
        t = tl.maximum(t, 0)
        sp = tl.load(wp + 1)
    elif ORDER:
        t = tl.load(work_ptr + tl.program_id(0) * 2)
        sp = tl.program_id(1)
        live = True
    else:
        t = tl.program_id(0)
        sp = tl.program_id(1)
        live = True
    h0 = tl.program_id(2) * BLOCK_H
    offs_h = h0 + tl.arange(0, BLOCK_H)
    hmask = (offs_h < heads) & live
    offs_r = tl.arange(0, R)
    offs_p = tl.arange(0, P_PAD)  # the rope part, zero-padded to an MMA-sized K (>= 16)
    pmask = offs_p < P
    q_rows = (t * heads + offs_h).to(tl.int64)
    q_lat = tl.load(q_lat_ptr + q_rows[:, None] * R + offs_r[None, :], mask=hmask[:, None], other=0.0)
    q_pe = tl.load(q_pe_ptr + q_rows[:, None] * P + offs_p[None, :], mask=hmask[:, None] & pmask[None, :], other=0.0)
    q_lat = mma_operand(q_lat, INTERPRET)
    q_pe = mma_operand(q_pe, INTERPRET)
    kv_base = 0
    if LOGICAL:
        kv_base = tl.load(kv_base_ptr + t)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)  # finite, so an all-masked block adds 0
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, R], dtype=tl.float32)
    # Triton's CPU interpreter takes no runtime loop bound: SPLIT_LEN carries the value there (with
    # WORK a bound: the entries past j1 are masked).
    if WORK:
        j0 = tl.load(wp + 2)
        j1 = tl.where(live, tl.load(wp + 3), j0)
        span = j1 - j0
    else:
        span = SPLIT_LEN if INTERPRET else split_len
        j0 = sp * span
        j1 = tl.minimum(j0 + span, topk)
        if ORDER:
            j1 = tl.minimum(j1, tl.load(work_ptr + tl.program_id(0) * 2 + 1))
    if ORDER:
        # The row's valid entries end at its count: the loop ends there (masked in the interpreter).
        n_end = tl.cdiv(tl.maximum(j1 - j0, 0), BLOCK_N) * BLOCK_N
    elif TRIM:
        # Loop only up to the last valid entry of this part of the list (prefill rows early in a
        # prompt select fewer than top-k keys and are -1 padded): a loop bound, not a branch around
        # the loads, so the loads stay pipelined. Compiled only (the interpreter needs a constexpr
        # trip count).
        offs_all = j0 + tl.arange(0, TRIM_LEN)
        row = tl.load(idx_ptr + t.to(tl.int64) * idx_stride + offs_all, mask=offs_all < j1, other=-1)
        n_end = tl.cdiv(tl.max(tl.where(row >= 0, offs_all - j0 + 1, 0), axis=0), BLOCK_N) * BLOCK_N
    if PREFETCH:
        # The next block's slots are loaded one iteration ahead into registers, so the software
        # pipeliner sees the row gather as a direct load (not an indirect one) and issues it
        # num_stages - 1 blocks ahead instead of (num_stages - 1) // 2.
        valid_nx, slot_nx = _block_slots(
            idx_ptr, kv_slots_ptr, kv_base, t, idx_stride, j0 + tl.arange(0, BLOCK_N), j1, LOGICAL
        )
        for n in range(0, n_end if (TRIM or ORDER) and not INTERPRET else (SPLIT_LEN if INTERPRET else span), BLOCK_N):
            valid, slot = valid_nx, slot_nx
            valid_nx, slot_nx = _block_slots(
                idx_ptr, kv_slots_ptr, kv_base, t, idx_stride, j0 + n + BLOCK_N + tl.arange(0, BLOCK_N), j1, LOGICAL
            )
            m_i, l_i, acc = _attend_block(
                q_lat, q_pe, slot, valid, m_i, l_i, acc, cache_ptr, cache_f32_ptr, cache_bf16_ptr, scale_log2,
                offs_r, offs_p, pmask, R, P, G, ROW_BYTES, BLOCK_N, FP8, MASK_ALL, INTERPRET,
            )  # fmt: skip
    else:
        for n in range(0, n_end if (TRIM or ORDER) and not INTERPRET else (SPLIT_LEN if INTERPRET else span), BLOCK_N):
            valid, slot = _block_slots(
                idx_ptr, kv_slots_ptr, kv_base, t, idx_stride, j0 + n + tl.arange(0, BLOCK_N), j1, LOGICAL
            )
            if SKIP_EMPTY:
                # A block with nothing valid would add nothing: its loads and products are skipped
                # (a branch around the loads: they are then not pipelined).
                if tl.max(valid.to(tl.int32), axis=0) > 0:
                    m_i, l_i, acc = _attend_block(
                        q_lat, q_pe, slot, valid, m_i, l_i, acc, cache_ptr, cache_f32_ptr, cache_bf16_ptr,
                        scale_log2, offs_r, offs_p, pmask, R, P, G, ROW_BYTES, BLOCK_N, FP8, MASK_ALL, INTERPRET,
                    )  # fmt: skip
            else:
                m_i, l_i, acc = _attend_block(
                    q_lat, q_pe, slot, valid, m_i, l_i, acc, cache_ptr, cache_f32_ptr, cache_bf16_ptr, scale_log2,
                    offs_r, offs_p, pmask, R, P, G, ROW_BYTES, BLOCK_N, FP8, MASK_ALL, INTERPRET,
                )  # fmt: skip

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLIT:
        part = (t * num_splits + sp).to(tl.int64) * heads + offs_h
        tl.store(o_ptr + part[:, None] * R + offs_r[None, :], out, mask=hmask[:, None])
        tl.store(lse_ptr + part, tl.where(has, m_i + tl.log2(l_i), float("-inf")), mask=hmask)
    else:
        tl.store(o_ptr + q_rows[:, None] * R + offs_r[None, :], cast(out, o_ptr.dtype.element_ty, INTERPRET), mask=hmask[:, None])


@triton.jit
def _combine_kernel(
    o_part_ptr, lse_ptr, out_ptr, counts_ptr, heads, num_splits, R: tl.constexpr, BLOCK_S: tl.constexpr,
    INTERPRET: tl.constexpr, COUNTS: tl.constexpr = False,
):  # fmt: skip
    """out[t, h] = sum_s 2^(lse_s - lse) o_s over the splits of (t, h); with COUNTS over the first
    counts[t] of them (a work plan's parts of row t; the others are not written)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < (tl.load(counts_ptr + t) if COUNTS else num_splits)
    part = (t * num_splits + offs_s).to(tl.int64) * heads + h
    lse = tl.load(lse_ptr + part, mask=smask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))
    w = w / tl.sum(w, axis=0)
    offs_r = tl.arange(0, R)
    o = tl.load(o_part_ptr + part[:, None] * R + offs_r[None, :], mask=smask[:, None], other=0.0)
    o = tl.sum(o * w[:, None], axis=0)
    tl.store(out_ptr + (t * heads + h).to(tl.int64) * R + offs_r, cast(o, out_ptr.dtype.element_ty, INTERPRET))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def sparse_mla_decode(
    q_lat: torch.Tensor,  # [T, H, R]
    q_pe: torch.Tensor,  # [T, H, P]
    latent_cache: torch.Tensor,  # [slots, R + P] model dtype, or uint8 [..., R + 4 R/G + 2 P]
    indices: torch.Tensor,  # int [T, K]: physical slots, or logical positions with token_kv_base
    softmax_scale: float,
    token_kv_base: torch.Tensor | None = None,  # int [T]: fuses slot = kv_slots[base[t] + index]
    kv_slots: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_h: int = 64,
    # Fastest of the H200 comparison in bench/kernels/bench_sparse_mla.py (64 heads, batch 1-256, fp8
    # and bf16 caches; bench/results/2026-11-29-triton-sparse-mla-v3): slots a block ahead, 64 rows and
    # 2 stages; for a single (token, head block) 32 rows and 3 stages (1.1x there, 0.85x at batch >= 64).
    block_n: int | None = None,
    num_warps: int = 8,
    num_stages: int | None = None,
    skip_empty: bool = False,
    prefetch: bool = True,
    trim: bool = False,
    mask_all: bool = False,
    out_dtype: torch.dtype = torch.float32,
    work=None,
    rows=None,
) -> torch.Tensor:
    """-> o_lat [T, H, R] in out_dtype (float32 by default). Device-only (no host sync): CUDA-graph
    capturable.

    work (mla_work.MlaWork, for lists that are whole contexts): the step's plan of parts, one
    program each, in place of num_splits and trim.
    rows (mla_rows.RowOrder): the step's row order: rows launched longest first, each program's
    loop ending at its row's count of valid entries (in place of trim).

    out_dtype: the model's dtype saves a pass over the output (the model rounds o_lat to it before
    the W_UV product anyway; the kernel's rounding is the same round-to-nearest-even).

    skip_empty: test each block of indices and skip those that are all -1 (costs a reduction per
    block and keeps the row loads out of the software pipeline).
    prefetch: load the next block's slots one iteration ahead in registers, so the software pipeliner
    sees the row gather as a direct load: issued num_stages - 1 blocks ahead (as an indirect load,
    (num_stages - 1) // 2) and the index load leaves the pipeline; skip_empty is then ignored (its
    branch would keep the loads out of the pipeline).
    trim: end each program's loop at the last valid (>= 0) entry of its part of the list (one read
    of the list first; compiled kernels only, the interpreter runs the whole list under masks).
    mask_all: mask the scale and k_pe loads of -1 entries too (they read slot 0 otherwise: one row
    read by every program with -1 entries). Not yet timed on the device."""
    tokens, heads, rank = q_lat.shape
    rope = q_pe.shape[2]
    topk = indices.shape[1]
    out = torch.empty(tokens, heads, rank, dtype=out_dtype, device=q_lat.device)
    if tokens == 0:
        return out
    group = min(128, rank)
    fp8, row_bytes, cache, f32_view, bf16_view = cache_views(latent_cache)
    logical = token_kv_base is not None
    if logical and kv_slots is None:
        raise ValueError("logical indices need kv_slots")
    block_h = min(block_h, max(16, triton.next_power_of_2(heads)))
    head_blocks = triton.cdiv(heads, block_h)
    single = tokens * head_blocks == 1 and prefetch
    block_n = block_n or (32 if single else 64)
    num_stages = num_stages or (3 if single else 2)
    num_splits, split_len, o_part, lse, grid = plan_launch(out, head_blocks, topk, block_n, num_splits, work)
    rows = None if work is not None else rows
    split, trim = num_splits > 1, trim and work is None and rows is None
    idx = indices.contiguous()
    interp = q_lat.device.type != "cuda"
    # The trim's scan of a list covers at least 2048 entries (DeepSeek-V3.2's and GLM-5's top-k), so
    # that lists of any length up to that compile one variant, not one per power of two.
    trim_len = max(TRIM_SCAN, triton.next_power_of_2(split_len))
    _sparse_mla_kernel[grid](
        q_lat.contiguous(), q_pe.contiguous(), cache, f32_view, bf16_view,
        idx, token_kv_base if logical else idx, kv_slots if logical else idx, o_part, lse,
        plan_pointer(idx, work, rows),
        heads, topk, topk, num_splits, softmax_scale * 1.4426950408889634, split_len,
        SPLIT_LEN=split_len if interp else 0, R=rank, P=rope, P_PAD=max(16, triton.next_power_of_2(rope)), G=group,
        ROW_BYTES=row_bytes, BLOCK_H=block_h, BLOCK_N=block_n, FP8=fp8, LOGICAL=logical, SPLIT=split,
        SKIP_EMPTY=skip_empty and not prefetch, PREFETCH=prefetch,
        TRIM=trim and not interp, TRIM_LEN=trim_len if trim else 16, MASK_ALL=mask_all,
        INTERPRET=interp, WORK=work is not None, ORDER=rows is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split:
        combine_splits(o_part, lse, out, None if work is None else work.counts)
    return out


def plan_pointer(idx: torch.Tensor, work, rows) -> torch.Tensor:
    """The kernels' work_ptr: a work plan's parts, a row order's rows, or (unused) the indices."""
    if work is not None:
        return work.parts
    return idx if rows is None else rows.rows


def cache_views(latent_cache: torch.Tensor):
    """-> (fp8, row width, rows [slots, width], float32 view, bf16 view) of a latent cache: the FP8
    row's scales are read as float32 and its k_pe as bf16 (the model-dtype cache is one view)."""
    fp8 = latent_cache.dtype == torch.uint8
    row_bytes = latent_cache.shape[-1]
    cache = latent_cache.contiguous().view(-1, row_bytes)
    if fp8:
        return fp8, row_bytes, cache, cache.view(torch.float32), cache.view(torch.bfloat16)
    return fp8, row_bytes, cache, cache, cache


def plan_splits(out: torch.Tensor, head_blocks: int, topk: int, block_n: int, num_splits: int | None):
    """The top-k lists' split across programs (flash-decoding) for out [T, H, R] -> (num_splits,
    split_len, o_part, lse): float32 partial outputs and log-sum-exps when split, else out itself.
    By default one full wave: a program holds a multiprocessor (its shared memory), so tokens x
    head blocks x splits up to the multiprocessor count, and no split shorter than two blocks."""
    tokens, heads, rank = out.shape
    if num_splits is None:
        num_splits = max(1, min(_num_sms(out.device) // (tokens * head_blocks), topk // (2 * block_n)))
    split_len = triton.cdiv(triton.cdiv(topk, num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(topk, split_len))
    if num_splits == 1:
        return 1, split_len, out, out
    o_part = torch.empty(tokens, num_splits, heads, rank, dtype=torch.float32, device=out.device)
    lse = torch.empty(tokens, num_splits, heads, dtype=torch.float32, device=out.device)
    return num_splits, split_len, o_part, lse


def combine_splits(o_part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, counts: torch.Tensor | None = None) -> None:
    """out [T, H, R] = the splits' partial outputs merged by their log-sum-exps; counts (int32
    [T], a work plan's): only the first counts[t] splits of row t."""
    tokens, num_splits, heads, rank = o_part.shape
    _combine_kernel[(tokens, heads)](
        o_part, lse, out, lse if counts is None else counts, heads, num_splits, R=rank,
        BLOCK_S=triton.next_power_of_2(num_splits), INTERPRET=out.device.type != "cuda", COUNTS=counts is not None,
        num_warps=4,
    )  # fmt: skip


def plan_launch(out: torch.Tensor, head_blocks: int, topk: int, block_n: int, num_splits: int | None, work):
    """-> (num_splits, split_len, o_part, lse, grid) of a decode launch: plan_splits' split with a
    (tokens, splits, head blocks) grid, or a work plan's (mla_work.MlaWork: one program a part;
    float32 partial outputs where rows have several parts, merged by combine_splits(...,
    counts=work.counts))."""
    tokens, heads, rank = out.shape
    if work is None:
        num_splits, split_len, o_part, lse = plan_splits(out, head_blocks, topk, block_n, num_splits)
        return num_splits, split_len, o_part, lse, (tokens, num_splits, head_blocks)
    grid = (work.parts.shape[0], 1, head_blocks)
    if work.max_parts == 1:
        return 1, topk, out, out, grid
    o_part = torch.empty(tokens, work.max_parts, heads, rank, dtype=torch.float32, device=out.device)
    lse = torch.empty(tokens, work.max_parts, heads, dtype=torch.float32, device=out.device)
    return work.max_parts, topk, o_part, lse, grid


# Entries the trim's scan covers at least (see sparse_mla_decode).
TRIM_SCAN = 2048
# From this many query tokens in a step, the step is treated as prefill: no splits are needed to fill
# the GPU, and the rows' -1 tails (short causal contexts) are worth trimming.
PREFILL_TOKENS = 256
# Launch options of the registry backend (bench/kernels/bench_sparse_mla.py sweeps the others).
DECODE_OPTIONS: dict = {}
PREFILL_OPTIONS: dict = {}
# The kernel of the registry backend: "gluon" (gluon_sparse_mla: hand-chosen layouts, no
# duplicated QK^T; Hopper only, this file's kernels take every call it does not) or "triton". On
# the H200 at GLM-5 shapes (bench/results/2026-12-02-gluon-sparse-mla-v2): 1.23-1.35x this file's
# decode launch at batch 64-1024, 1.13x at batch 1, 1.48-1.59x its prefill launch on 2048-token
# chunks. NSASERVE_SPARSE_MLA_KERNEL=triton selects this file's kernels (for A/B runs).
KERNEL = os.environ.get("NSASERVE_SPARSE_MLA_KERNEL", "gluon")
# From how many query tokens a call of the "gluon" kernel runs warp-specialised
# (gluon_sparse_mla_ws: a softmax, a PV and a producer warpgroup) rather than in lock step, by
# cache. On the H200 at GLM-5 shapes (bench/results/2026-12-04-gluon-sparse-mla-ws*.md), against the
# lock-step kernel: bf16 cache 1.14x at 64 tokens, 1.26-1.28x at 128-256, 1.14-1.28x at 1024, 1.24-1.28x
# on 2048-token prompt chunks, 0.98x at one token. FP8 cache (its producer warpgroup, dequantising
# alone, is the slower side): with the bit-operation dequantisation and q copied in its softmax
# partition (bench/results/2026-12-04-gluon-sparse-mla-fp8-bits-r1, -r2) 0.99x at 64 tokens, 1.06x
# at 128, 1.06-1.07x at 256; before them 1.02-1.04x at 256-1024 and on prompt chunks.
# NSASERVE_SPARSE_MLA_WS=none keeps every call in lock step, =all sends every call from two
# tokens (for A/B runs).
WS_FROM_TOKENS = {"bf16": 2, "fp8": 128}
WS_MODE = os.environ.get("NSASERVE_SPARSE_MLA_WS", "auto")
if WS_MODE not in ("auto", "none", "all"):
    raise ValueError(f"NSASERVE_SPARSE_MLA_WS={WS_MODE!r}: expected auto, none or all")


# The step's work plan (mla_work) for decode-sized steps whose lists are whole contexts: every
# row cut into parts of one length, the parts longest first, so that the programs' work evens out
# across the multiprocessors whatever the mix of context lengths. NSASERVE_MLA_WORK=on turns it
# on (the model then plans once a step and every layer's call reads the plan). Off by default: on
# the H200 its kernels took 1.3-2.4x the trimmed ones' time on contexts spread over 819-2048 and
# the model's decode step gained nothing (bench/results/2026-12-05-sparse-mla-spread.md,
# 2026-12-05-step-profile-mla-work-plan.md).
MLA_WORK = os.environ.get("NSASERVE_MLA_WORK", "off")
if MLA_WORK not in ("on", "off"):
    raise ValueError(f"NSASERVE_MLA_WORK={MLA_WORK!r}: expected on or off")


# The step's row order (mla_rows): rows launched longest first, each program's loop ending at its
# row's count of valid entries, for every call over all of a step's rows (the model orders once a
# step and every layer's call reads the order). NSASERVE_MLA_ROW_ORDER: "graphs" (the default)
# orders the decode steps run as CUDA graphs, "on" every step, "off" none. Measured on the H200
# (bench/results/2026-12-05-step-profile-row-order.md): in graphs at 256 rows spread over 819-2047
# tokens in a shuffled order the sparse MLA took 1.64 against 2.14 ms a step (9 layers), already
# longest first 1.71 against 1.70. Eager steps are bound by the host's launches (22-40 ms of host
# for 13-17 ms of kernels), so a shorter kernel gains them nothing and the order's few launches
# only add to the host's work: none there. (That profile's eager steps, 28 against 21 ms with the
# order, were the host's speed differing between two processes: a later pair measured 22 ms with
# it against 34 without, every host function slower in the second process;
# 2026-12-05-step-profile-timeline-h100.md.)
ROW_ORDER = os.environ.get("NSASERVE_MLA_ROW_ORDER", "graphs")
if ROW_ORDER not in ("graphs", "on", "off"):
    raise ValueError(f"NSASERVE_MLA_ROW_ORDER={ROW_ORDER!r}: expected graphs, on or off")


def plan_attention_work(row_pos: torch.Tensor, width: int, whole_contexts: bool = True, graph: bool = False):
    """The registry backend's plan for a step (sparse_mla_triton's work=), or None where it plans
    nothing. row_pos: each row's position (its list holds min(row_pos + 1, width) valid entries
    first); width: the lists' width; whole_contexts: the lists are whole contexts; graph: the step
    is a CUDA-graph decode step (captured, or run to warm up before its capture). A work plan
    (MLA_WORK on, whole contexts, a decode-sized step), else the row order (ROW_ORDER on, or
    graphs for a graph step)."""
    rows = row_pos.numel()
    if MLA_WORK == "on" and whole_contexts and 0 < rows < PREFILL_TOKENS:
        from .mla_work import plan_mla_work

        return plan_mla_work(row_pos + 1, width, _num_sms(row_pos.device))
    ordered = ROW_ORDER == "on" or (ROW_ORDER == "graphs" and graph)
    if ordered and rows > 0:
        from .mla_rows import plan_row_order

        return plan_row_order(row_pos, width)
    return None


def _takes_ws(q_lat, q_pe, latent_cache) -> bool:
    """Whether a call goes to the warp-specialised kernel (WS_MODE, WS_FROM_TOKENS, its shapes)."""
    if WS_MODE == "none":
        return False
    least = 2 if WS_MODE == "all" else WS_FROM_TOKENS["fp8" if latent_cache.dtype == torch.uint8 else "bf16"]
    if q_lat.shape[0] < least:
        return False
    from . import gluon_sparse_mla_ws

    return gluon_sparse_mla_ws.supports(q_lat, q_pe, latent_cache)


def sparse_mla_prefill(q_lat, q_pe, latent_cache, indices, softmax_scale, token_kv_base=None, kv_slots=None, **kw):
    """Sparse MLA over many query tokens (a prompt chunk): every (token, head block) is one
    program walking its own top-k list up to its last valid entry (early rows of a prompt select
    fewer than top-k keys). Same math and arguments as sparse_mla_decode. Defaults: the fastest of
    the H200 comparison (2048 query tokens, full and causal lists): slots a block ahead, the loop
    trimmed, 32 rows, 4 stages; with prefetch=False, blocks of -1 entries are skipped by a branch."""
    kw.setdefault("prefetch", True)
    kw.setdefault("trim", True)
    if kw["prefetch"]:
        kw.setdefault("block_n", 32)
        kw.setdefault("num_stages", 4)
    kw.setdefault("skip_empty", True)
    kw.setdefault("num_splits", 1)
    return sparse_mla_decode(q_lat, q_pe, latent_cache, indices, softmax_scale, token_kv_base, kv_slots, **kw)


def sparse_mla_triton(
    q_lat, q_pe, latent_cache, slots, softmax_scale, whole_contexts: bool = False, work=None
) -> torch.Tensor:
    """The registry's ("attention", "triton") backend: same arguments as sparse_mla_torch; the
    output comes in q_lat's dtype (the model's), which the model casts it to either way.

    whole_contexts: decode trims each row's loop at its last valid entry too (prefill always
    does). A decode CUDA graph's lists are as wide as its context bucket, so rows shorter than the
    bucket end in -1 padding: at contexts of ~1400 in the 2048 bucket, about a third of each row.
    work: the step's plan from plan_attention_work (this function's plan_work attribute, which
    the model calls once a step for calls over all of its rows): decode calls run a work plan's
    parts; every call runs a row order's rows in its order."""
    from .mla_rows import RowOrder

    kw = {"out_dtype": q_lat.dtype}
    if isinstance(work, RowOrder):
        kw["rows"] = work
    elif work is not None and q_lat.shape[0] < PREFILL_TOKENS:
        kw["work"] = work
    if KERNEL == "gluon":
        from . import gluon_sparse_mla  # Triton's experimental dialect: imported only when chosen

        if gluon_sparse_mla.supports(q_lat, q_pe, latent_cache):
            # A prompt chunk's rows end early in -1 (short causal contexts): its loops are trimmed.
            trim = whole_contexts or q_lat.shape[0] >= PREFILL_TOKENS
            if _takes_ws(q_lat, q_pe, latent_cache):
                from . import gluon_sparse_mla_ws

                if q_lat.shape[0] >= PREFILL_TOKENS:
                    kw["num_splits"] = 1  # a prompt chunk fills the GPU without splits
                return gluon_sparse_mla_ws.sparse_mla_decode_ws(
                    q_lat, q_pe, latent_cache, slots, softmax_scale, trim=trim, **kw
                )
            return gluon_sparse_mla.sparse_mla_decode_gluon(
                q_lat, q_pe, latent_cache, slots, softmax_scale, trim=trim, **kw
            )
    if q_lat.shape[0] >= PREFILL_TOKENS:
        return sparse_mla_prefill(q_lat, q_pe, latent_cache, slots, softmax_scale, **{**kw, **PREFILL_OPTIONS})
    if whole_contexts:
        kw["trim"] = True
    return sparse_mla_decode(q_lat, q_pe, latent_cache, slots, softmax_scale, **{**kw, **DECODE_OPTIONS})


# The model asks the backend for its step plan through this attribute (model/attention.py).
sparse_mla_triton.plan_work = plan_attention_work
