"""Triton exact per-row top-k over indexer logits, emitted in position order.

Contract (indexer.select_topk's set): row t chooses the min(topk, pos_t + 1) largest of
logits[t, :pos_t + 1]; among equal values the lower position wins; -1 pads the row. Positions come
out in ascending order, not by score: the set is what attention consumes, and position order is
what makes the emit one prefix sum.

_topk_kernel, one program per row: logits map to uint32 keys whose unsigned order is the float
order; a radix select finds the k-th largest key, BITS bits a pass from the top (Triton's
histogram is warp ballots, its cost grows with 2^BITS: 4-bit digits were fastest on the H200),
then every key above it and the first keys equal to it are written. Rows whose context fits in
top-k take everything. Rows longer than CHUNK keys are re-read chunk by chunk.

_topk_sampled_kernel: first brackets the k-th value between two of 256 sorted samples of the
row, compacts the keys inside the bracket (usually a few hundred) and runs the radix select over
those alone; when the bracket misses or holds more than 1024 keys, over the whole row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Largest row a program keeps in registers; longer rows are re-read in chunks of this size.
CHUNK = 8192

# The streamed select's bracket: sample ranks this far either side of the k-th largest's expected
# rank (of 256 samples). Narrower brackets compact fewer keys (the select over them costs less, and
# fewer long rows overflow the 1024 candidates into the full-row select); wider ones miss less often
# (also the full-row select). Measured on the H200, 8K prompt's top-k alone (bench/results/
# 2026-12-02-topk-select.md), with the select's array sized by its keys: margin 6 / 8 / 10 / 12 / 14
# / 16 / 20 / 24: 730 / 620 / 540 / 489-494 / 481 / 511 / 617 / 752 us.
STREAM_MARGIN = 14


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
def _narrow(hist, prefix, k_rem, PASS: tl.constexpr, BITS: tl.constexpr):
    """One pass's choice: the largest digit d with at least k_rem keys at or above it joins the
    prefix, and the keys above d (at_or_above[d + 1], the largest count still below k_rem) leave
    k_rem. Both from one reduction."""
    NPASS: tl.constexpr = (32 + BITS - 1) // BITS
    FIRST: tl.constexpr = 32 - BITS * (NPASS - 1)
    SHIFT: tl.constexpr = 32 - FIRST - BITS * PASS
    digits = tl.arange(0, 1 << BITS)
    at_or_above = tl.cumsum(hist, axis=0, reverse=True)
    d_sel, above = tl.reduce(
        (tl.where(at_or_above >= k_rem, digits, -1), tl.where(at_or_above < k_rem, at_or_above, 0)), 0, _max_pair
    )
    return prefix | (d_sel.to(tl.uint32) << SHIFT), k_rem - above


@triton.jit
def _radix_select(u, valid, k, BITS: tl.constexpr):
    """(k-th largest of the valid keys u, how many keys equal to it are among the top k)."""
    prefix = tl.zeros((), dtype=tl.uint32)
    k_rem = k
    for i in tl.static_range((32 + BITS - 1) // BITS):
        prefix, k_rem = _narrow(_radix_hist(u, valid, prefix, i, BITS), prefix, k_rem, i, BITS)
    return prefix, k_rem


@triton.jit
def _radix_select_chunks(row_logits, offs, pos, k, n_chunks, CHUNK: tl.constexpr, BITS: tl.constexpr):
    """_radix_select over a row of n_chunks chunks, re-read from memory every pass."""
    prefix = tl.zeros((), dtype=tl.uint32)
    k_rem = k
    for i in tl.static_range((32 + BITS - 1) // BITS):
        hist = tl.zeros([1 << BITS], dtype=tl.int32)
        for c in range(n_chunks):
            u, valid = _order_keys(row_logits, c * CHUNK + offs, pos)
            hist += _radix_hist(u, valid, prefix, i, BITS)
        prefix, k_rem = _narrow(hist, prefix, k_rem, i, BITS)
    return prefix, k_rem


@triton.jit
def _bracket_pass(u, valid, prefix, k_rem, lo, diff, PASS: tl.constexpr, BITS: tl.constexpr):
    """One pass of _select_in_bracket: where lo and hi (diff = lo ^ hi) agree on every bit from this
    digit up, every key in [lo, hi] has lo's digit, so no histogram is needed."""
    NPASS: tl.constexpr = (32 + BITS - 1) // BITS
    FIRST: tl.constexpr = 32 - BITS * (NPASS - 1)
    SHIFT: tl.constexpr = 32 - FIRST - BITS * PASS
    if (diff >> SHIFT) == 0:
        prefix = lo >> SHIFT << SHIFT
    else:
        prefix, k_rem = _narrow(_radix_hist(u, valid, prefix, PASS, BITS), prefix, k_rem, PASS, BITS)
    return prefix, k_rem


@triton.jit
def _select_in_bracket(scratch_row, n, k, lo, hi, C: tl.constexpr, BITS: tl.constexpr):
    """_radix_select over the n (<= C) keys compacted to scratch_row, all within [lo, hi]: the
    digits lo and hi share (sign, exponent and the top of the mantissa, when the bracket is narrow)
    are known without a pass. C: the array the select works on, so fewer keys cost less."""
    c = tl.arange(0, C)
    valid = c < n
    u = tl.load(scratch_row + c, mask=valid, other=0).to(tl.uint32, bitcast=True)
    diff = lo ^ hi
    prefix = tl.zeros((), dtype=tl.uint32)
    k_rem = k
    for i in tl.static_range((32 + BITS - 1) // BITS):
        prefix, k_rem = _bracket_pass(u, valid, prefix, k_rem, lo, diff, i, BITS)
    return prefix, k_rem


@triton.jit
def _emit(out_row, u, valid, p, thr, k_rem, gt_seen, eq_seen):
    """Writes positions p of keys above thr, and of the first k_rem keys equal to it (counting the
    gt_seen / eq_seen of earlier chunks), at their places in position order. One scan of
    (greater, equal) packed in 16-bit halves gives both running counts. -> this chunk's counts."""
    gt = valid & (u > thr)
    eq = valid & (u == thr)
    packed = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), axis=0)
    c_gt = gt_seen + (packed & 0xFFFF)
    c_eq = eq_seen + (packed >> 16)
    take = gt | (eq & (c_eq <= k_rem))
    tl.store(out_row + c_gt + tl.minimum(c_eq, k_rem) - 1, p.to(tl.int64), mask=take)
    total = tl.sum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), axis=0)  # both counts, one reduction
    return total & 0xFFFF, total >> 16


@triton.jit
def _this_row(logits_ptr, row_pos_ptr, out_ptr, logits_stride, out_stride, topk):
    """This program's row: (last visible position, how many to choose, its logits, its output)."""
    row = tl.program_id(0)
    pos = tl.load(row_pos_ptr + row)
    return pos, tl.minimum(topk, pos + 1), logits_ptr + row * logits_stride, out_ptr + row * out_stride


# Row lengths are runtime values, not specialised: the kernels compile once per chunk size, not
# once per context length (as constants, each new length of a serving step cost a 2-4 s compile).
# The logits' row stride stays specialised: indexer_logits pads it to a multiple of 16.
@triton.jit(do_not_specialize=["out_stride", "width", "nchunk"])
def _topk_kernel(
    logits_ptr, row_pos_ptr, out_ptr, logits_stride, out_stride, topk, width, nchunk,
    CHUNK: tl.constexpr, MULTI: tl.constexpr, NCHUNK: tl.constexpr, BITS: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """MULTI: rows of more than one chunk (nchunk of them). NCHUNK: nchunk again, for Triton's CPU
    interpreter, which takes no runtime loop bound (0 when compiled)."""
    pos, k_eff, row_logits, out_row = _this_row(logits_ptr, row_pos_ptr, out_ptr, logits_stride, out_stride, topk)
    offs = tl.arange(0, CHUNK)
    if pos + 1 <= topk:
        # The whole causal context fits: every position is chosen (prompt rows early in a prefill).
        for c in range(NCHUNK if INTERPRET else nchunk):
            p = c * CHUNK + offs
            tl.store(out_row + p, tl.where(p <= pos, p, -1).to(tl.int64), mask=p < width)
    else:
        if not MULTI:
            u, valid = _order_keys(row_logits, offs, pos)
            thr, k_rem = _radix_select(u, valid, k_eff, BITS)
            _emit(out_row, u, valid, offs, thr, k_rem, 0, 0)
        else:
            thr, k_rem = _radix_select_chunks(row_logits, offs, pos, k_eff, NCHUNK if INTERPRET else nchunk, CHUNK, BITS)
            gt_seen = 0
            eq_seen = 0
            for c in range(NCHUNK if INTERPRET else nchunk):
                p = c * CHUNK + offs
                u, valid = _order_keys(row_logits, p, pos)
                n_gt, n_eq = _emit(out_row, u, valid, p, thr, k_rem, gt_seen, eq_seen)
                gt_seen += n_gt
                eq_seen += n_eq
        # Pad the rest of the row with -1 here rather than in a separate fill launch.
        for c in range(NCHUNK if INTERPRET else nchunk):
            p = c * CHUNK + offs
            tl.store(out_row + p, tl.full([CHUNK], -1, tl.int64), mask=(p >= k_eff) & (p < width))


@triton.jit
def _sample_bracket(row_logits, pos, n, k_eff, SAMPLES: tl.constexpr, MARGIN: tl.constexpr):
    """Order keys (hi, lo) bracketing the k-th largest of a row of n keys, from SAMPLES evenly
    spaced samples: the sample ranks MARGIN either side of where the k-th largest is expected."""
    j = tl.arange(0, SAMPLES)
    su, _ = _order_keys(row_logits, (j * n) // SAMPLES, pos)
    ss = tl.sort(su, dim=0, descending=True)
    r = (k_eff * SAMPLES) // n  # expected rank of the k-th largest among the samples
    zero = tl.zeros_like(ss)
    hi = tl.max(tl.where(j == tl.maximum(r - MARGIN, 0), ss, zero), axis=0)
    lo = tl.max(tl.where(j == tl.minimum(r + MARGIN, SAMPLES - 1), ss, zero), axis=0)
    return hi, lo


@triton.jit(do_not_specialize=["out_stride", "width"])
def _topk_sampled_kernel(
    logits_ptr, row_pos_ptr, out_ptr, scratch_ptr, logits_stride, out_stride, topk, width,
    CHUNK: tl.constexpr, SAMPLES: tl.constexpr, MARGIN: tl.constexpr, CAND: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """Rows of at most CHUNK keys; the bracket is sample ranks +-MARGIN around the expected rank of
    the k-th largest; at most CAND keys inside it are compacted to scratch."""
    pos, k_eff, row_logits, out_row = _this_row(logits_ptr, row_pos_ptr, out_ptr, logits_stride, out_stride, topk)
    offs = tl.arange(0, CHUNK)
    if pos + 1 <= topk:
        tl.store(out_row + offs, tl.where(offs <= pos, offs, -1).to(tl.int64), mask=offs < width)
    else:
        u, valid = _order_keys(row_logits, offs, pos)
        n = pos + 1
        hi, lo = _sample_bracket(row_logits, pos, n, k_eff, SAMPLES, MARGIN)
        above_hi = valid & (u > hi)
        inside = valid & (u >= lo) & (u <= hi)
        # Both counts from one reduction (16-bit halves: rows are at most CHUNK <= 32K keys).
        counts = tl.sum(above_hi.to(tl.int32) + (inside.to(tl.int32) << 16), axis=0)
        n_above = counts & 0xFFFF
        n_inside = counts >> 16
        if (n_above < k_eff) & (n_above + n_inside >= k_eff) & (n_inside <= CAND):
            dst = tl.cumsum(inside.to(tl.int32), axis=0) - 1
            scratch_row = scratch_ptr + tl.program_id(0) * CAND
            tl.store(scratch_row + dst, u.to(tl.int32, bitcast=True), mask=inside)
            tl.debug_barrier()  # the compacted keys are read back by other threads of this program
            c = tl.arange(0, CAND)
            cvalid = c < n_inside
            cu = tl.load(scratch_row + c, mask=cvalid, other=0).to(tl.uint32, bitcast=True)
            thr, k_rem = _radix_select(cu, cvalid, k_eff - n_above, BITS)
        else:
            thr, k_rem = _radix_select(u, valid, k_eff, BITS)
        _emit(out_row, u, valid, offs, thr, k_rem, 0, 0)
        tl.store(out_row + offs, tl.full([CHUNK], -1, tl.int64), mask=(offs >= k_eff) & (offs < width))


@triton.jit(do_not_specialize=["out_stride", "width"])
def _topk_streamed_kernel(
    logits_ptr, row_pos_ptr, out_ptr, scratch_ptr, logits_stride, out_stride, topk, width,
    SUB: tl.constexpr, SAMPLES: tl.constexpr, MARGIN: tl.constexpr, CAND: tl.constexpr, BITS: tl.constexpr,
    WTILES: tl.constexpr, NSUB: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """(WTILES = cdiv(width, SUB) <= cdiv(topk, SUB): the output's pieces. Compiled, a row walks its
    own pieces, a runtime count: a constant bound from the step's longest row made every 512 keys
    of it a new variant, a 6 s compile in the middle of serving on the H200. NSUB = cdiv(longest
    row, SUB) bounds the loops only under Triton's CPU interpreter, which takes no runtime loop
    bound (0 when compiled).)
    The sampled select for long rows at a throughput: the row is streamed in SUB-key pieces
    (only as many as the row has: work follows its length, registers follow SUB, so several rows
    share a multiprocessor). Pass 1 counts keys above / inside the samples' bracket and compacts
    those inside to scratch; the radix select runs over them (or, when the bracket misses or holds
    more than CAND, over the whole row re-read per pass); pass 2 emits in position order."""
    pos, k_eff, row_logits, out_row = _this_row(logits_ptr, row_pos_ptr, out_ptr, logits_stride, out_stride, topk)
    offs = tl.arange(0, SUB)
    n = pos + 1
    nsub = (n + SUB - 1) // SUB
    if n <= topk:
        for c in tl.static_range(WTILES):
            p = c * SUB + offs
            tl.store(out_row + p, tl.where(p <= pos, p, -1).to(tl.int64), mask=p < width)
    else:
        hi, lo = _sample_bracket(row_logits, pos, n, k_eff, SAMPLES, MARGIN)
        scratch_row = scratch_ptr + tl.program_id(0).to(tl.int64) * CAND
        n_above = 0
        n_inside = 0
        for c in range(NSUB if INTERPRET else nsub):  # pieces past nsub: skipped
            if c < nsub:
                u, valid = _order_keys(row_logits, c * SUB + offs, pos)
                above_hi = valid & (u > hi)
                inside = valid & (u >= lo) & (u <= hi)
                dst = n_inside + tl.cumsum(inside.to(tl.int32), axis=0) - 1
                tl.store(scratch_row + dst, u.to(tl.int32, bitcast=True), mask=inside & (dst < CAND))
                counts = tl.sum(above_hi.to(tl.int32) + (inside.to(tl.int32) << 16), axis=0)  # one reduction
                n_above += counts & 0xFFFF
                n_inside += counts >> 16
        if (n_above < k_eff) & (n_above + n_inside >= k_eff) & (n_inside <= CAND):
            tl.debug_barrier()  # the compacted keys are read back by other threads of this program
            k_in = k_eff - n_above
            if CAND >= 256:  # the select's cost follows its array: a quarter or half of CAND when the keys fit
                if n_inside <= CAND // 4:
                    thr, k_rem = _select_in_bracket(scratch_row, n_inside, k_in, lo, hi, CAND // 4, BITS)
                elif n_inside <= CAND // 2:
                    thr, k_rem = _select_in_bracket(scratch_row, n_inside, k_in, lo, hi, CAND // 2, BITS)
                else:
                    thr, k_rem = _select_in_bracket(scratch_row, n_inside, k_in, lo, hi, CAND, BITS)
            else:
                thr, k_rem = _select_in_bracket(scratch_row, n_inside, k_in, lo, hi, CAND, BITS)
        else:
            thr, k_rem = _radix_select_chunks(row_logits, offs, pos, k_eff, NSUB if INTERPRET else nsub, SUB, BITS)
        gt_seen = 0
        eq_seen = 0
        for c in range(NSUB if INTERPRET else nsub):  # pieces past nsub: skipped
            if c < nsub:
                p = c * SUB + offs
                u, valid = _order_keys(row_logits, p, pos)
                n_gt, n_eq = _emit(out_row, u, valid, p, thr, k_rem, gt_seen, eq_seen)
                gt_seen += n_gt
                eq_seen += n_eq
        for c in tl.static_range(WTILES):
            p = c * SUB + offs
            tl.store(out_row + p, tl.full([SUB], -1, tl.int64), mask=(p >= k_eff) & (p < width))


def _warps(chunk: int) -> int:
    # Measured on an H200 (first version): a 4K row was fastest with 8 warps (15.7 us vs 17.3 with
    # 16, 33 with 4); an 8K row with 16 (29 us vs 41 with 8).
    return 16 if chunk >= 8192 else 8 if chunk >= 4096 else 4


def topk_of_logits(
    logits: torch.Tensor,
    row_pos: torch.Tensor,
    topk: int,
    num_warps: int | None = None,
    bits: int = 4,
    sampled: bool = True,
    stream: int | None = None,
) -> torch.Tensor:
    """Positions [T, min(topk, L)] of each row's top-k among logits[t, :row_pos[t] + 1]; -1 padded.

    bits: digit width of the radix select. sampled: bracket the k-th value with sorted samples
    first (rows of up to CHUNK keys; longer rows use the plain select). stream: the sampled
    select streamed in pieces of this many keys (_topk_streamed_kernel; rows of any length)."""
    rows, max_len = logits.shape
    width = min(topk, max_len)
    out = torch.empty((rows, width), dtype=torch.int64, device=logits.device)  # every entry is written
    if stream:
        sub = min(stream, triton.next_power_of_2(max(max_len, 16)))
        cand = 1024 if sub >= 256 else sub
        scratch = torch.empty((rows, cand), dtype=torch.int32, device=logits.device)
        interp = logits.device.type != "cuda"
        _topk_streamed_kernel[(rows,)](
            logits, row_pos, out, scratch, logits.stride(0), out.stride(0), topk, width,
            SUB=sub, SAMPLES=min(sub, 256), MARGIN=STREAM_MARGIN, CAND=cand, BITS=bits, WTILES=triton.cdiv(width, sub),
            NSUB=triton.cdiv(max_len, sub) if interp else 0, INTERPRET=interp, num_warps=num_warps or (8 if sub >= 4096 else 4),
        )  # fmt: skip
        return out
    chunk = min(CHUNK, triton.next_power_of_2(max_len))
    warps = num_warps or _warps(chunk)
    if sampled and max_len <= chunk:
        cand = min(chunk, 1024)
        scratch = torch.empty((rows, cand), dtype=torch.int32, device=logits.device)
        _topk_sampled_kernel[(rows,)](
            logits, row_pos, out, scratch, logits.stride(0), out.stride(0), topk, width,
            CHUNK=chunk, SAMPLES=min(chunk, 256), MARGIN=16, CAND=cand, BITS=bits, num_warps=warps,
        )  # fmt: skip
    else:
        nchunk = triton.cdiv(max_len, chunk)
        interp = logits.device.type != "cuda"
        _topk_kernel[(rows,)](
            logits, row_pos, out, logits.stride(0), out.stride(0), topk, width, nchunk,
            CHUNK=chunk, MULTI=nchunk > 1, NCHUNK=nchunk if interp else 0, BITS=bits, INTERPRET=interp, num_warps=warps,
        )  # fmt: skip
    return out
