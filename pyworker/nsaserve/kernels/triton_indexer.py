"""Triton lightning indexer: paged logits, then an exact per-row top-k (two launches, no host sync).

Same contract as indexer.indexer_topk_torch (scores, causal mask, "lower position wins" on ties),
except that each row's positions come out in ascending position order rather than by score: the
set is what attention consumes, and emitting in position order is what makes the selection cheap.

1. _logits_kernel, grid (rows, key spans): gathers BLOCK_N keys at a time of the row's request
   through kv_slots (bf16 rows, or DeepGEMM's fp8 paged layout: codes then one fp32 scale per
   key) and multiplies them with the row's [heads, D] query on the tensor cores. The products must
   be float32-accurate, or the selected set drifts from the float32 reference at its boundary:
   fp8 and bf16 keys are exact in bf16 and the query is split exactly into three bf16 parts
   (3 bf16 MMAs); other key dtypes use 3xTF32. Then ReLU, the head weights, one logit per key.
2. _topk_kernel, one program per row: maps each logit to an order-preserving integer, finds the
   k-th largest by radix select (four 8-bit histogram passes), then emits every key above it plus
   the lowest-position keys equal to it, compacted with a prefix sum.
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


@triton.jit
def _logits_kernel(
    q_ptr, w_ptr, kv_slots_ptr, row_kv_off_ptr, row_pos_ptr,
    k_ptr, k_scale_ptr, out_ptr,
    out_stride, heads, scale, page_size,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPAN_BLOCKS: tl.constexpr,
    FP8: tl.constexpr, SPLIT_Q: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    n_start = tl.program_id(1) * (SPAN_BLOCKS * BLOCK_N)
    pos = tl.load(row_pos_ptr + row)  # last key this row may see (causal)
    if n_start > pos:
        return
    kv_off = tl.load(row_kv_off_ptr + row)
    offs_d = tl.arange(0, D)
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < heads
    q = tl.load(q_ptr + row * heads * D + offs_h[:, None] * D + offs_d[None, :], mask=hmask[:, None], other=0.0)
    w = tl.load(w_ptr + row * heads + offs_h, mask=hmask, other=0.0)
    if SPLIT_Q:
        # fp8 and bf16 keys are exact in bf16, and q = q1 + q2 + q3 exactly with bf16 parts: three
        # bf16 MMAs give float32-exact products (only the summation order differs from fp32).
        q1 = mma_operand(q, INTERPRET)
        r = q - q1.to(tl.float32)
        q2 = mma_operand(r, INTERPRET)
        q3 = mma_operand(r - q2.to(tl.float32), INTERPRET)
    for b in range(SPAN_BLOCKS):
        offs_n = n_start + b * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = offs_n <= pos
        slot = tl.load(kv_slots_ptr + kv_off + offs_n, mask=valid, other=0).to(tl.int64)
        if FP8:
            # Page p holds page_size rows of D codes, then page_size fp32 scales.
            page = slot // page_size
            off = slot - page * page_size
            base = page * (page_size * (D + 4))
            codes = tl.load(k_ptr + (base + off * D)[:, None] + offs_d[None, :], mask=valid[:, None], other=0)
            keys = codes.to(tl.float8e4nv, bitcast=True)
            k_scale = tl.load(k_scale_ptr + (base + page_size * D) // 4 + off, mask=valid, other=0.0)
        else:
            keys = tl.load(k_ptr + slot[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
        # Keys on the MMA's M side (BLOCK_N rows), heads on N: no padding of a 32-head query to 64.
        if SPLIT_Q:
            kb = mma_operand(keys, INTERPRET)
            s = tl.dot(kb, tl.trans(q1)) + tl.dot(kb, tl.trans(q2)) + tl.dot(kb, tl.trans(q3))
        else:
            s = tl.dot(keys.to(tl.float32), tl.trans(q), input_precision=PRECISION)  # [BLOCK_N, BLOCK_H]
        if FP8:
            s = s * k_scale[:, None]
        s = tl.maximum(s * scale, 0.0)
        logit = tl.sum(s * w[None, :], axis=1)
        tl.store(out_ptr + row * out_stride + offs_n, logit, mask=valid)


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
) -> torch.Tensor:
    """float32 [T, max_len] logits; entries after a row's position are left unwritten."""
    rows, heads, dim = q.shape
    logits = torch.empty(rows, max_len, dtype=torch.float32, device=q.device)
    fp8 = index_k_cache.dtype == torch.uint8
    cache = index_k_cache.contiguous()
    k_scale = cache.view(torch.float32) if fp8 else cache  # scales read as fp32 through this view
    interp = q.device.type != "cuda"
    blocks = triton.cdiv(max_len, block_n)
    # Several key blocks per program (the query is loaded once, the gathers pipelined), but enough
    # programs for about two per multiprocessor.
    span = max(1, min(16, blocks * rows // (programs_wanted or _PROGRAMS_WANTED)))
    span = 1 << (span.bit_length() - 1)  # a power of two: few distinct compiled variants
    _logits_kernel[(rows, triton.cdiv(blocks, span))](
        q.contiguous().float(), weights.contiguous().float(), kv_slots, row_kv_off, row_pos, cache, k_scale,
        logits, logits.stride(0), heads, softmax_scale, page_size,
        D=dim, BLOCK_H=max(16, triton.next_power_of_2(heads)), BLOCK_N=block_n, SPAN_BLOCKS=span,
        FP8=fp8, SPLIT_Q=fp8 or cache.dtype == torch.bfloat16, PRECISION="ieee" if interp else "tf32x3",
        INTERPRET=interp, num_warps=num_warps, num_stages=3,
    )  # fmt: skip
    return logits


def _topk_warps(chunk: int) -> int:
    # Measured on an H200: a 4K row was fastest with 8 warps (15.7 us vs 17.3 with 16, 33 with 4);
    # an 8K row with 16 (29 us vs 41 with 8, where the int64 keys no longer fit in registers).
    return 16 if chunk >= 8192 else 8 if chunk >= 4096 else 4


def topk_of_logits(
    logits: torch.Tensor, row_pos: torch.Tensor, topk: int, num_warps: int | None = None
) -> torch.Tensor:
    """Positions [T, min(topk, L)] of each row's top-k among logits[t, :row_pos[t] + 1]; -1 padded."""
    rows, max_len = logits.shape
    width = min(topk, max_len)
    out = torch.empty((rows, width), dtype=torch.int64, device=logits.device)  # every entry is written
    chunk = min(_TOPK_CHUNK, triton.next_power_of_2(max_len))
    _topk_kernel[(rows,)](
        logits, row_pos, out, logits.stride(0), out.stride(0), topk, width,
        CHUNK=chunk, NCHUNK=triton.cdiv(max_len, chunk), num_warps=num_warps or _topk_warps(chunk),
    )  # fmt: skip
    return out


def indexer_topk_rows(
    q, weights, index_k_cache, kv_slots, row_kv_off, row_pos, max_len, topk, softmax_scale, page_size
):
    """Device-only part (no host sync, CUDA-graph capturable): logical positions [T, min(topk, max_len)]."""
    if q.shape[0] == 0 or max_len == 0 or topk == 0:
        return torch.full((q.shape[0], min(topk, max_len)), -1, dtype=torch.int64, device=q.device)
    logits = indexer_logits(q, weights, index_k_cache, kv_slots, row_kv_off, row_pos, max_len, softmax_scale, page_size)
    return topk_of_logits(logits, row_pos, topk)


def indexer_topk_triton(
    q, weights, index_k_cache, kv_slots, query_start, cached_lens, seq_lens, topk, softmax_scale, page_size
) -> torch.Tensor:
    """The registry's ("indexer", "triton") backend: same arguments as indexer_topk_torch."""
    row_kv_off, row_pos = row_metadata(query_start, cached_lens, seq_lens, q.device)
    return indexer_topk_rows(
        q, weights, index_k_cache, kv_slots, row_kv_off, row_pos, max(seq_lens, default=0), topk,
        softmax_scale, page_size,
    )  # fmt: skip
