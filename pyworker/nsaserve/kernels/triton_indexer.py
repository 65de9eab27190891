"""Triton lightning indexer: paged logits, then an exact per-row top-k (two launches, no host sync).

Same contract as indexer.indexer_topk_torch (scores, causal mask, "lower position wins" on ties),
except that each row's positions come out in ascending position order rather than by score: the
set is what attention consumes, and emitting in position order is what makes the selection cheap.

1. _logits_kernel, grid (row blocks, key spans): reads BLOCK_N keys at a time of the rows'
   request (bf16 rows, or DeepGEMM's fp8 paged layout: a page's codes, then one fp32 scale per
   key). kv_slots are page-aligned (position p at page * page_size + p % page_size, as the
   worker builds them), so a block inside one page is one kv_slots lookup and one contiguous
   tile. Keys go on the MMA's M side against the query's [heads, D] (decode: one row per
   program; prefill: ROWS rows of one request share each key tile, N = ROWS x heads). The
   products must be float32-accurate, or the chosen set drifts from the float32 reference at its
   boundary: fp8 keys are exact in fp16 and the query, scaled by a power of two, is split into two
   fp16 parts (22 significant bits; "fp16x2"), or exact in bf16 with a three-part bf16 split
   ("bf16x3", also bf16 keys); other key dtypes use 3xTF32. A one-pass fp16 query ("fp16") is
   available where speed matters more than exact ties. Then ReLU, head weights, one logit a key.
2. _topk32_kernel, one program per row: maps each logit to an order-preserving uint32, finds the
   k-th largest by radix select (TOPK_BITS-bit histogram passes), then emits every key above it
   plus the lowest-position keys equal to it, compacted with one prefix sum. Rows whose context
   fits in top-k take everything. _topk_sampled_kernel first brackets the k-th value between two
   of 256 sorted samples and runs the radix select over the keys inside the bracket only (the
   whole row when the bracket misses). _topk_kernel is the first version (int64 keys, 8 bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import mma_operand

# Largest row the top-k kernel keeps in registers; longer rows are re-read in chunks of this size.
_TOPK_CHUNK = 8192
# Logits programs to aim for (about two per multiprocessor of an H100/H200).
_PROGRAMS_WANTED = 264
# Options of the device path (indexer_topk_rows); bench/kernels/bench_indexer.py times the others.
# fp16x2 with page-contiguous loads: 21.7 us at batch 64, 4K on the H200 (v1's gather, bf16x3: 30.8).
LOGITS_OPTIONS: dict = {"split": "fp16x2", "paged": True}
# Query rows of one request per logits program in prefill (the MMA's N side is this x heads).
PREFILL_ROWS = 4
# Top-k: the fastest on the H200 by batch 1 + batch 64 at 4K (bench/results/2026-11-29-triton-indexer-v2):
# 4-bit digits after the sampled bracket, 11.1 + 14.9 us (8-bit int64, the first version: 15.0 + 16.8).
TOPK_BITS: int | None = 4  # digit width of the int32 radix select; None: the int64 8-bit kernel
TOPK_SAMPLED = True  # bracket the k-th value with sorted samples before the radix select


@triton.jit
def _load_keys(
    k_ptr, k_scale_ptr, kv_slots_ptr, kv_off, n0, pos, offs_n, valid, offs_d,
    D: tl.constexpr, PS: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, ONE_PAGE: tl.constexpr,
):  # fmt: skip
    """Keys [BLOCK_N, D] at positions offs_n = n0 + [0, BLOCK_N) of the row's request, valid up to
    position pos (and fp8 scales [BLOCK_N])."""
    if ONE_PAGE:
        # The block lies in one page (positions p of a request live at page * PS + p % PS): one
        # slot lookup for the block, then a contiguous tile of the page.
        # (masked: a block past the row's last key must not read past the request's kv_slots)
        first = tl.load(kv_slots_ptr + kv_off + n0, mask=n0 <= pos, other=0).to(tl.int64)
        page = first // PS
        off = (n0 % PS) + tl.arange(0, BLOCK_N)
    else:
        slot = tl.load(kv_slots_ptr + kv_off + offs_n, mask=valid, other=0).to(tl.int64)
        page = slot // PS
        off = slot - page * PS
    # One return for both layouts: the compiler wants consistent return types even across
    # constexpr branches.
    if FP8:
        # Page p holds PS rows of D codes, then PS fp32 scales.
        base = page * (PS * (D + 4))
        codes = tl.load(k_ptr + (base + off * D)[:, None] + offs_d[None, :], mask=valid[:, None], other=0)
        k_scale = tl.load(k_scale_ptr + (base + PS * D) // 4 + off, mask=valid, other=0.0)
        keys = codes.to(tl.float8e4nv, bitcast=True)
    else:
        keys = tl.load(k_ptr + (page * PS + off)[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
        k_scale = keys
    return keys, k_scale


@triton.jit
def _logits_kernel(
    q_ptr, w_ptr, kv_slots_ptr, row_kv_off_ptr, row_pos_ptr, blk_row0_ptr, blk_rows_ptr,
    k_ptr, k_scale_ptr, out_ptr,
    out_stride, heads, scale,
    D: tl.constexpr, PS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPAN_BLOCKS: tl.constexpr,
    ROWS: tl.constexpr, FP8: tl.constexpr, MODE: tl.constexpr, ONE_PAGE: tl.constexpr, PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """Logits of ROWS consecutive query rows of one request (ROWS = 1: one row per program, decode;
    more: a prompt chunk's rows share each key tile, the MMA's N side is ROWS x heads).

    MODE 0: 3xTF32 (keys not exact in bf16); 1: q split into three bf16 parts; 2: q split into
    two fp16 parts after a power-of-two scaling (fp8 keys only: e4m3 is exact in fp16); 3: the
    first fp16 part alone (11 significant bits: near-ties may swap at the top-k boundary)."""
    n_start = tl.program_id(1) * (SPAN_BLOCKS * BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_c = tl.arange(0, ROWS * BLOCK_H)  # MMA columns: (row j, head h) = (c // BLOCK_H, c % BLOCK_H)
    offs_j = tl.arange(0, ROWS)
    if ROWS == 1:
        row0 = tl.program_id(0)
        nrows = 1
    else:
        row0 = tl.load(blk_row0_ptr + tl.program_id(0))
        nrows = tl.load(blk_rows_ptr + tl.program_id(0))
    pos_j = tl.load(row_pos_ptr + row0 + offs_j, mask=offs_j < nrows, other=-1)  # last key each row sees
    pos = tl.max(pos_j, axis=0)
    if n_start > pos:
        return
    kv_off = tl.load(row_kv_off_ptr + row0)
    cmask = ((offs_c % BLOCK_H) < heads) & ((offs_c // BLOCK_H) < nrows)
    q_row = (row0 + offs_c // BLOCK_H) * heads + offs_c % BLOCK_H
    q = tl.load(q_ptr + q_row[:, None] * D + offs_d[None, :], mask=cmask[:, None], other=0.0)
    w = tl.load(w_ptr + q_row, mask=cmask, other=0.0)
    if MODE == 1:
        # fp8 and bf16 keys are exact in bf16, and q = q1 + q2 + q3 exactly with bf16 parts: three
        # bf16 MMAs give float32-exact products (only the summation order differs from fp32).
        q1 = mma_operand(q, INTERPRET)
        r = q - q1.to(tl.float32)
        q2 = mma_operand(r, INTERPRET)
        q3 = mma_operand(r - q2.to(tl.float32), INTERPRET)
    if MODE >= 2:
        # q * 2^e (largest element near 2^14, inside fp16's range) = q1 + q2 / 2^11 with fp16 parts:
        # 22 significant bits, within rounding of float32 products. Powers of two scale exactly.
        amax = tl.maximum(tl.max(tl.max(tl.abs(q), axis=1), axis=0), 1e-30)
        e = 14 - tl.ceil(tl.log2(amax)).to(tl.int32)
        e = tl.minimum(tl.maximum(e, -126), 127)
        up = ((e + 127) << 23).to(tl.float32, bitcast=True)
        down = ((127 - e) << 23).to(tl.float32, bitcast=True)
        qs = q * up
        q1 = qs.to(tl.float16)
        q2 = ((qs - q1.to(tl.float32)) * 2048.0).to(tl.float16)
        if INTERPRET:  # the interpreter's fp16 dots are not exact either: carry the values in fp32
            q1 = q1.to(tl.float32)
            q2 = q2.to(tl.float32)
    for b in range(SPAN_BLOCKS):
        n0 = n_start + b * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n <= pos
        keys, k_scale = _load_keys(
            k_ptr, k_scale_ptr, kv_slots_ptr, kv_off, n0, pos, offs_n, valid, offs_d, D, PS, BLOCK_N, FP8, ONE_PAGE
        )
        # Keys on the MMA's M side (BLOCK_N rows), heads on N: no padding of a 32-head query to 64.
        if MODE == 1:
            kb = mma_operand(keys, INTERPRET)
            s = tl.dot(kb, tl.trans(q1)) + tl.dot(kb, tl.trans(q2)) + tl.dot(kb, tl.trans(q3))
        elif MODE >= 2:
            kh = keys.to(tl.float16)
            if INTERPRET:
                kh = kh.to(tl.float32)
            s = tl.dot(kh, tl.trans(q1))
            if MODE == 2:
                s += tl.dot(kh, tl.trans(q2)) * (1.0 / 2048.0)
            s = s * down
        else:
            s = tl.dot(keys.to(tl.float32), tl.trans(q), input_precision=PRECISION)  # [BLOCK_N, ROWS * BLOCK_H]
        if FP8:
            s = s * k_scale[:, None]
        s = tl.maximum(s * scale, 0.0) * w[None, :]
        if ROWS == 1:
            tl.store(out_ptr + row0 * out_stride + offs_n, tl.sum(s, axis=1), mask=valid)
        else:
            logit = tl.sum(tl.reshape(s, [BLOCK_N, ROWS, BLOCK_H]), axis=2)  # [BLOCK_N, ROWS]
            ptrs = out_ptr + (row0 + offs_j)[None, :].to(tl.int64) * out_stride + offs_n[:, None]
            tl.store(ptrs, logit, mask=(offs_n[:, None] <= pos_j[None, :]) & (offs_j[None, :] < nrows))


@triton.jit
def _sort_keys(logits_ptr, offs, pos):
    """Logits -> int64 keys whose order is the float order; keys after `pos` become -1."""
    valid = offs <= pos
    x = tl.load(logits_ptr + offs, mask=valid, other=0.0)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 and +0.0 must tie, as they do for torch.sort
    b = x.to(tl.int32, bitcast=True)
    # Negative floats: flip the magnitude bits so that larger magnitude sorts lower.
    k = (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648  # now in [0, 2^32)
    return tl.where(valid, k, -1)


@triton.jit
def _digit_hist(keys, prefix, shift):
    """Histogram of the 8-bit digit at `shift` over keys whose higher bits equal prefix's."""
    match = (keys >> (shift + 8)) == (prefix >> (shift + 8))  # masked keys (-1) never match
    return tl.histogram(((keys >> shift) & 255).to(tl.int32), 256, mask=match)


@triton.jit
def _topk_kernel(
    logits_ptr, row_pos_ptr, out_ptr, logits_stride, out_stride, topk, width,
    CHUNK: tl.constexpr, NCHUNK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    pos = tl.load(row_pos_ptr + row)
    k_eff = tl.minimum(topk, pos + 1)
    row_logits = logits_ptr + row * logits_stride
    offs = tl.arange(0, CHUNK)
    digits = tl.arange(0, 256)

    # Radix select, 8 bits a pass from the top: thr ends as the k_eff-th largest key, and k_rem as
    # how many keys equal to thr belong to the top k_eff.
    thr = tl.zeros((), dtype=tl.int64)
    k_rem = k_eff
    if NCHUNK == 1:
        keys = _sort_keys(row_logits, offs, pos)
    for radix_pass in tl.static_range(4):
        shift = 24 - 8 * radix_pass
        if NCHUNK == 1:
            hist = _digit_hist(keys, thr, shift)
        else:
            hist = tl.zeros([256], dtype=tl.int32)
            for c in range(NCHUNK):
                hist += _digit_hist(_sort_keys(row_logits, c * CHUNK + offs, pos), thr, shift)
        at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys with digit >= d
        d_sel = tl.max(tl.where(at_or_above >= k_rem, digits, -1), axis=0)
        k_rem -= tl.sum(tl.where(digits > d_sel, hist, 0), axis=0)
        thr = thr | (d_sel.to(tl.int64) << shift)

    # Emit, in position order: every key above thr, and the first k_rem keys equal to it.
    ties_seen = 0
    emitted = 0
    for c in range(NCHUNK):
        p = c * CHUNK + offs
        keys = _sort_keys(row_logits, p, pos)
        eq = (keys == thr).to(tl.int32)
        eq_rank = ties_seen + tl.cumsum(eq, axis=0)  # 1-based rank among ties so far
        take = (keys > thr) | ((eq == 1) & (eq_rank <= k_rem))
        take_i = take.to(tl.int32)
        dst = emitted + tl.cumsum(take_i, axis=0) - 1
        tl.store(out_ptr + row * out_stride + dst, p.to(tl.int64), mask=take)
        ties_seen += tl.sum(eq, axis=0)
        emitted += tl.sum(take_i, axis=0)
    # Pad the rest of the row with -1 here rather than in a separate fill launch.
    for c in range(NCHUNK):
        p = c * CHUNK + offs
        tl.store(out_ptr + row * out_stride + p, tl.full([CHUNK], -1, tl.int64), mask=(p >= emitted) & (p < width))


@triton.jit
def _order_keys(logits_ptr, offs, pos):
    """Logits -> (uint32 keys whose unsigned order is the float order, valid = offs <= pos)."""
    valid = offs <= pos
    x = tl.load(logits_ptr + offs, mask=valid, other=0.0)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 and +0.0 must tie, as they do for torch.sort
    b = x.to(tl.int32, bitcast=True)
    k = b ^ ((b >> 31) & 0x7FFFFFFF)  # signed int order == float order (negatives: magnitude flipped)
    u = k.to(tl.uint32, bitcast=True) ^ tl.full([], 0x80000000, tl.uint32)  # sign bit flipped: unsigned
    return u, valid


@triton.jit
def _max_pair(a1, b1, a2, b2):
    return tl.maximum(a1, a2), tl.maximum(b1, b2)


@triton.jit
def _radix_hist(u, valid, prefix, PASS: tl.constexpr, BITS: tl.constexpr):
    """Histogram (2^BITS bins) of pass PASS's digit over valid keys whose bits above the digit equal
    prefix's. Pass 0 takes the top 32 - BITS * (passes - 1) bits, every later pass BITS bits."""
    NPASS: tl.constexpr = (32 + BITS - 1) // BITS
    FIRST: tl.constexpr = 32 - BITS * (NPASS - 1)
    WIDTH: tl.constexpr = FIRST * (PASS == 0) + BITS * (PASS != 0)
    SHIFT: tl.constexpr = 32 - FIRST - BITS * PASS
    match = valid
    if SHIFT + WIDTH < 32:
        match = match & ((u >> (SHIFT + WIDTH)) == (prefix >> (SHIFT + WIDTH)))
    digit = ((u >> SHIFT) & ((1 << WIDTH) - 1)).to(tl.int32)
    return tl.histogram(digit, 1 << BITS, mask=match)


@triton.jit
def _topk32_kernel(
    logits_ptr, row_pos_ptr, out_ptr, logits_stride, out_stride, topk, width,
    CHUNK: tl.constexpr, NCHUNK: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """Per row: radix select of the k-th largest over uint32 keys, BITS bits a pass from the top
    (the first pass takes the remainder), then one emit pass in position order."""
    row = tl.program_id(0)
    pos = tl.load(row_pos_ptr + row)
    k_eff = tl.minimum(topk, pos + 1)
    row_logits = logits_ptr + row * logits_stride
    offs = tl.arange(0, CHUNK)
    digits = tl.arange(0, 1 << BITS)
    NPASS: tl.constexpr = (32 + BITS - 1) // BITS
    FIRST: tl.constexpr = 32 - BITS * (NPASS - 1)

    if pos + 1 <= topk:
        # The whole causal context fits: every position is chosen (prompt rows early in a prefill).
        for c in range(NCHUNK):
            p = c * CHUNK + offs
            tl.store(out_ptr + row * out_stride + p, tl.where(p <= pos, p, -1).to(tl.int64), mask=p < width)
    else:
        prefix = tl.zeros((), dtype=tl.uint32)
        k_rem = k_eff
        if NCHUNK == 1:
            u, valid = _order_keys(row_logits, offs, pos)
        for i in tl.static_range(NPASS):
            shift = 32 - FIRST - BITS * i  # of this pass's digit (constexpr: i is)
            if NCHUNK == 1:
                hist = _radix_hist(u, valid, prefix, i, BITS)
            else:
                hist = tl.zeros([1 << BITS], dtype=tl.int32)
                for c in range(NCHUNK):
                    uc, vc = _order_keys(row_logits, c * CHUNK + offs, pos)
                    hist += _radix_hist(uc, vc, prefix, i, BITS)
            at_or_above = tl.cumsum(hist, axis=0, reverse=True)  # keys with digit >= d
            # The chosen digit is the largest d with at_or_above[d] >= k_rem; the keys above it number
            # at_or_above[d + 1], the largest count still below k_rem. One reduction for both.
            d_sel, above = tl.reduce(
                (tl.where(at_or_above >= k_rem, digits, -1), tl.where(at_or_above < k_rem, at_or_above, 0)),
                0,
                _max_pair,
            )
            k_rem -= above
            prefix = prefix | (d_sel.to(tl.uint32) << shift)

        # Emit in position order: keys above the threshold, and the first k_rem keys equal to it. One
        # scan of (greater, equal) packed in 16-bit halves gives both running counts:
        # destination = greater so far + min(equal so far, k_rem) - 1.
        gt_seen = 0
        eq_seen = 0
        for c in range(NCHUNK):
            p = c * CHUNK + offs
            if NCHUNK != 1:
                u, valid = _order_keys(row_logits, p, pos)
            gt = valid & (u > prefix)
            eq = valid & (u == prefix)
            packed = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), axis=0)
            c_gt = gt_seen + (packed & 0xFFFF)
            c_eq = eq_seen + (packed >> 16)
            take = gt | (eq & (c_eq <= k_rem))
            dst = c_gt + tl.minimum(c_eq, k_rem) - 1
            tl.store(out_ptr + row * out_stride + dst, p.to(tl.int64), mask=take)
            gt_seen += tl.sum(gt.to(tl.int32), axis=0)
            eq_seen += tl.sum(eq.to(tl.int32), axis=0)
        # Pad the rest of the row with -1 here rather than in a separate fill launch.
        for c in range(NCHUNK):
            p = c * CHUNK + offs
            tl.store(out_ptr + row * out_stride + p, tl.full([CHUNK], -1, tl.int64), mask=(p >= k_eff) & (p < width))


@triton.jit
def _radix_select(u, valid, k, BITS: tl.constexpr):
    """(k-th largest of the valid uint32 keys u, how many keys equal to it are among the top k)."""
    digits = tl.arange(0, 1 << BITS)
    NPASS: tl.constexpr = (32 + BITS - 1) // BITS
    FIRST: tl.constexpr = 32 - BITS * (NPASS - 1)
    prefix = tl.zeros((), dtype=tl.uint32)
    k_rem = k
    for i in tl.static_range(NPASS):
        shift = 32 - FIRST - BITS * i  # of this pass's digit (constexpr: i is)
        hist = _radix_hist(u, valid, prefix, i, BITS)
        at_or_above = tl.cumsum(hist, axis=0, reverse=True)
        d_sel, above = tl.reduce(
            (tl.where(at_or_above >= k_rem, digits, -1), tl.where(at_or_above < k_rem, at_or_above, 0)),
            0,
            _max_pair,
        )
        k_rem -= above
        prefix = prefix | (d_sel.to(tl.uint32) << shift)
    return prefix, k_rem


@triton.jit
def _topk_sampled_kernel(
    logits_ptr, row_pos_ptr, out_ptr, scratch_ptr, logits_stride, out_stride, topk, width,
    CHUNK: tl.constexpr, SAMPLES: tl.constexpr, MARGIN: tl.constexpr, CAND: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """Per row (at most CHUNK keys): the k-th largest bracketed by SAMPLES sorted samples (ranks
    +-MARGIN around the expected one), the keys inside the bracket (usually a few hundred)
    compacted to scratch, and the radix select run over those alone; when the bracket misses or
    holds more than CAND keys, the radix select runs over the whole row. Same result as
    _topk32_kernel."""
    row = tl.program_id(0)
    pos = tl.load(row_pos_ptr + row)
    k_eff = tl.minimum(topk, pos + 1)
    row_logits = logits_ptr + row * logits_stride
    offs = tl.arange(0, CHUNK)
    if pos + 1 <= topk:
        tl.store(out_ptr + row * out_stride + offs, tl.where(offs <= pos, offs, -1).to(tl.int64), mask=offs < width)
    else:
        u, valid = _order_keys(row_logits, offs, pos)
        n = pos + 1
        j = tl.arange(0, SAMPLES)
        su, _ = _order_keys(row_logits, (j * n) // SAMPLES, pos)
        ss = tl.sort(su, dim=0, descending=True)
        r = (k_eff * SAMPLES) // n  # expected rank of the k-th largest among the samples
        zero = tl.zeros_like(ss)
        hi = tl.max(tl.where(j == tl.maximum(r - MARGIN, 0), ss, zero), axis=0)
        lo = tl.max(tl.where(j == tl.minimum(r + MARGIN, SAMPLES - 1), ss, zero), axis=0)
        above_hi = valid & (u > hi)
        inside = valid & (u >= lo) & (u <= hi)
        # Both counts from one reduction (16-bit halves: rows are at most CHUNK <= 32K keys).
        counts = tl.sum(above_hi.to(tl.int32) + (inside.to(tl.int32) << 16), axis=0)
        n_above = counts & 0xFFFF
        n_inside = counts >> 16
        if (n_above < k_eff) & (n_above + n_inside >= k_eff) & (n_inside <= CAND):
            dst = tl.cumsum(inside.to(tl.int32), axis=0) - 1
            tl.store(scratch_ptr + row * CAND + dst, u.to(tl.int32, bitcast=True), mask=inside)
            tl.debug_barrier()  # the compacted keys are read back by other threads of this program
            c = tl.arange(0, CAND)
            cvalid = c < n_inside
            cu = tl.load(scratch_ptr + row * CAND + c, mask=cvalid, other=0).to(tl.uint32, bitcast=True)
            thr, k_rem = _radix_select(cu, cvalid, k_eff - n_above, BITS)
        else:
            thr, k_rem = _radix_select(u, valid, k_eff, BITS)
        gt = valid & (u > thr)
        eq = valid & (u == thr)
        packed = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), axis=0)
        c_gt = packed & 0xFFFF
        c_eq = packed >> 16
        take = gt | (eq & (c_eq <= k_rem))
        tl.store(out_ptr + row * out_stride + c_gt + tl.minimum(c_eq, k_rem) - 1, offs.to(tl.int64), mask=take)
        tl.store(
            out_ptr + row * out_stride + offs, tl.full([CHUNK], -1, tl.int64), mask=(offs >= k_eff) & (offs < width)
        )


def row_metadata(
    query_start: list[int], cached_lens: list[int], seq_lens: list[int], device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row: offset of its request in kv_slots, and its own (last visible) position."""
    kv_off, pos = [], []
    off = 0
    for i, seq in enumerate(seq_lens):
        n = query_start[i + 1] - query_start[i]
        kv_off += [off] * n
        pos += range(cached_lens[i], cached_lens[i] + n)
        off += seq
    as_dev = lambda v: torch.tensor(v, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
    return as_dev(kv_off), as_dev(pos)


def row_blocks(query_start: list[int], rows_per: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Blocks of up to rows_per consecutive query rows of one request: (first row, row count, rows_per)."""
    first, count = [], []
    for i in range(len(query_start) - 1):
        for r in range(query_start[i], query_start[i + 1], rows_per):
            first.append(r)
            count.append(min(rows_per, query_start[i + 1] - r))
    as_dev = lambda v: torch.tensor(v, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
    return as_dev(first), as_dev(count), rows_per


def indexer_logits(
    q: torch.Tensor,  # [T, H, D] float32
    weights: torch.Tensor,  # [T, H] float32
    index_k_cache: torch.Tensor,  # bf16/fp16/fp32 [slots, D] or uint8 [pages, page_size, D + 4]
    kv_slots: torch.Tensor,  # int [sum seq_lens]
    row_kv_off: torch.Tensor,  # int32 [T]
    row_pos: torch.Tensor,  # int32 [T]
    max_len: int,  # longest context among the rows' requests (sizes the logits)
    softmax_scale: float,
    page_size: int,
    block_n: int = 64,
    num_warps: int = 4,
    programs_wanted: int | None = None,
    split: str = "bf16x3",
    paged: bool = True,
    num_stages: int = 3,
    row_blocks: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """float32 [T, max_len] logits; entries after a row's position are left unwritten.

    paged: kv_slots are page-aligned (position p of a request at page * page_size + p % page_size,
    as the worker builds them), so a block of keys within one page is one contiguous load.
    split: how the float32 query meets fp8/bf16 keys on the tensor cores, "bf16x3" or (fp8 keys
    only) "fp16x2", both float32-accurate; or (fp8 keys only) "fp16", one pass, not exact.
    row_blocks: (first row int32 [NB], row count int32 [NB], ROWS): blocks of up to ROWS
    consecutive query rows of one request that share key tiles (prefill); None: a row per program."""
    rows, heads, dim = q.shape
    logits = torch.empty(rows, max_len, dtype=torch.float32, device=q.device)
    fp8 = index_k_cache.dtype == torch.uint8
    cache = index_k_cache.contiguous()
    k_scale = cache.view(torch.float32) if fp8 else cache  # scales read as fp32 through this view
    interp = q.device.type != "cuda"
    blocks = triton.cdiv(max_len, block_n)
    if row_blocks is None:
        blk_row0 = blk_rows = row_pos
        n_row_blocks, rows_per = rows, 1
    else:
        blk_row0, blk_rows, rows_per = row_blocks
        n_row_blocks = blk_row0.shape[0]
    # Several key blocks per program (the query is loaded once, the gathers pipelined), but enough
    # programs for about two per multiprocessor.
    span = max(1, min(16, blocks * n_row_blocks // (programs_wanted or _PROGRAMS_WANTED)))
    span = 1 << (span.bit_length() - 1)  # a power of two: few distinct compiled variants
    if fp8 and split in ("fp16x2", "fp16"):
        mode = 2 if split == "fp16x2" else 3
    else:
        mode = 1 if fp8 or cache.dtype == torch.bfloat16 else 0
    _logits_kernel[(n_row_blocks, triton.cdiv(blocks, span))](
        q.contiguous().float(), weights.contiguous().float(), kv_slots, row_kv_off, row_pos, blk_row0, blk_rows,
        cache, k_scale, logits, logits.stride(0), heads, softmax_scale,
        D=dim, PS=page_size, BLOCK_H=max(16, triton.next_power_of_2(heads)), BLOCK_N=block_n, SPAN_BLOCKS=span,
        ROWS=rows_per, FP8=fp8, MODE=mode, ONE_PAGE=paged and page_size % block_n == 0, PRECISION="ieee" if interp else "tf32x3",
        INTERPRET=interp, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return logits


def _topk_warps(chunk: int) -> int:
    # Measured on an H200: a 4K row was fastest with 8 warps (15.7 us vs 17.3 with 16, 33 with 4);
    # an 8K row with 16 (29 us vs 41 with 8, where the int64 keys no longer fit in registers).
    return 16 if chunk >= 8192 else 8 if chunk >= 4096 else 4


def topk_of_logits(
    logits: torch.Tensor,
    row_pos: torch.Tensor,
    topk: int,
    num_warps: int | None = None,
    bits: int | None = None,
    sampled: bool = False,
) -> torch.Tensor:
    """Positions [T, min(topk, L)] of each row's top-k among logits[t, :row_pos[t] + 1]; -1 padded.

    bits: digit width of the int32 radix select (None: the older int64 8-bit kernel).
    sampled: bracket the k-th value with sorted samples first (rows up to _TOPK_CHUNK keys)."""
    rows, max_len = logits.shape
    width = min(topk, max_len)
    out = torch.empty((rows, width), dtype=torch.int64, device=logits.device)  # every entry is written
    chunk = min(_TOPK_CHUNK, triton.next_power_of_2(max_len))
    if sampled and bits is not None and max_len <= chunk:
        cand = min(chunk, 1024)
        scratch = torch.empty((rows, cand), dtype=torch.int32, device=logits.device)
        _topk_sampled_kernel[(rows,)](
            logits, row_pos, out, scratch, logits.stride(0), out.stride(0), topk, width,
            CHUNK=chunk, SAMPLES=min(chunk, 256), MARGIN=16, CAND=cand, BITS=bits,
            num_warps=num_warps or _topk_warps(chunk),
        )  # fmt: skip
        return out
    if bits is not None:
        _topk32_kernel[(rows,)](
            logits, row_pos, out, logits.stride(0), out.stride(0), topk, width,
            CHUNK=chunk, NCHUNK=triton.cdiv(max_len, chunk), BITS=bits, num_warps=num_warps or _topk_warps(chunk),
        )  # fmt: skip
        return out
    _topk_kernel[(rows,)](
        logits, row_pos, out, logits.stride(0), out.stride(0), topk, width,
        CHUNK=chunk, NCHUNK=triton.cdiv(max_len, chunk), num_warps=num_warps or _topk_warps(chunk),
    )  # fmt: skip
    return out


def indexer_topk_rows(
    q, weights, index_k_cache, kv_slots, row_kv_off, row_pos, max_len, topk, softmax_scale, page_size, blocks=None
):
    """Device-only part (no host sync, CUDA-graph capturable): logical positions [T, min(topk, max_len)]."""
    if q.shape[0] == 0 or max_len == 0 or topk == 0:
        return torch.full((q.shape[0], min(topk, max_len)), -1, dtype=torch.int64, device=q.device)
    logits = indexer_logits(
        q, weights, index_k_cache, kv_slots, row_kv_off, row_pos, max_len, softmax_scale, page_size,
        row_blocks=blocks, **LOGITS_OPTIONS,
    )  # fmt: skip
    return topk_of_logits(logits, row_pos, topk, bits=TOPK_BITS, sampled=TOPK_SAMPLED)


def indexer_topk_triton(
    q, weights, index_k_cache, kv_slots, query_start, cached_lens, seq_lens, topk, softmax_scale, page_size
) -> torch.Tensor:
    """The registry's ("indexer", "triton") backend: same arguments as indexer_topk_torch."""
    row_kv_off, row_pos = row_metadata(query_start, cached_lens, seq_lens, q.device)
    rows, requests = query_start[-1], len(seq_lens)
    # Prompt chunks (several rows per request on average): rows share key tiles in blocks.
    blocks = row_blocks(query_start, PREFILL_ROWS, q.device) if rows >= 4 * max(1, requests) else None
    return indexer_topk_rows(
        q, weights, index_k_cache, kv_slots, row_kv_off, row_pos, max(seq_lens, default=0), topk,
        softmax_scale, page_size, blocks,
    )  # fmt: skip
