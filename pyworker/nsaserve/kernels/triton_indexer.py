"""Triton lightning indexer: paged logits, then an exact per-row top-k (two launches, no host sync).

Same contract as indexer.indexer_topk_torch (scores, causal mask, "lower position wins" on ties),
except that each row's positions come out in ascending position order rather than by score: the
set is what attention consumes, and emitting in position order is what makes the selection cheap.

1. _logits_kernel, grid (rows, key blocks): gathers BLOCK_N keys of the row's request through
   kv_slots (bf16 rows, or DeepGEMM's fp8 paged layout: codes then one fp32 scale per key), does
   [heads, D] x [D, BLOCK_N] on the tensor cores in 3xTF32 (float32-accurate, so the selected set
   matches the float32 reference rather than drifting at the boundary), applies ReLU and the head
   weights and writes one float32 logit per key.
2. _topk_kernel, one program per row: maps each logit to an order-preserving integer, finds the
   k-th largest by a 32-step bitwise binary search (one count per bit), then emits every key
   above it plus the lowest-position keys equal to it, compacted with a prefix sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Largest row the top-k kernel keeps in registers; longer rows are re-read in chunks of this size.
_TOPK_CHUNK = 8192


@triton.jit
def _logits_kernel(
    q_ptr, w_ptr, kv_slots_ptr, row_kv_off_ptr, row_pos_ptr,
    k_ptr, k_scale_ptr, out_ptr,
    out_stride, heads, scale, page_size,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    pos = tl.load(row_pos_ptr + row)  # last key this row may see (causal)
    if n0 > pos:
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    valid = offs_n <= pos
    kv_off = tl.load(row_kv_off_ptr + row)
    slot = tl.load(kv_slots_ptr + kv_off + offs_n, mask=valid, other=0).to(tl.int64)
    offs_d = tl.arange(0, D)
    if FP8:
        # Page p holds page_size rows of D codes, then page_size fp32 scales.
        page = slot // page_size
        off = slot - page * page_size
        base = page * (page_size * (D + 4))
        codes = tl.load(k_ptr + (base + off * D)[:, None] + offs_d[None, :], mask=valid[:, None], other=0)
        keys = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        k_scale = tl.load(k_scale_ptr + (base + page_size * D) // 4 + off, mask=valid, other=0.0)
    else:
        keys = tl.load(k_ptr + slot[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < heads
    q = tl.load(q_ptr + row * heads * D + offs_h[:, None] * D + offs_d[None, :], mask=hmask[:, None], other=0.0)
    s = tl.dot(q, tl.trans(keys), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N]
    if FP8:
        s = s * k_scale[None, :]
    s = tl.maximum(s * scale, 0.0)
    w = tl.load(w_ptr + row * heads + offs_h, mask=hmask, other=0.0)
    logit = tl.sum(s * w[:, None], axis=0)
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
def _topk_kernel(
    logits_ptr, row_pos_ptr, out_ptr, logits_stride, out_stride, topk,
    CHUNK: tl.constexpr, NCHUNK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    pos = tl.load(row_pos_ptr + row)
    k_eff = tl.minimum(topk, pos + 1)
    row_logits = logits_ptr + row * logits_stride
    offs = tl.arange(0, CHUNK)

    # Bitwise search for thr = the k_eff-th largest key: the largest value with
    # count(key >= value) >= k_eff. Masked keys (-1) are never counted since candidates are >= 1.
    thr = tl.zeros((), dtype=tl.int64)
    if NCHUNK == 1:
        keys = _sort_keys(row_logits, offs, pos)
        for i in tl.static_range(32):
            cand = thr + (1 << (31 - i))
            cnt = tl.sum((keys >= cand).to(tl.int32), axis=0)
            thr = tl.where(cnt >= k_eff, cand, thr)
    else:
        for i in tl.static_range(32):
            cand = thr + (1 << (31 - i))
            cnt = 0
            for c in range(NCHUNK):
                keys = _sort_keys(row_logits, c * CHUNK + offs, pos)
                cnt += tl.sum((keys >= cand).to(tl.int32), axis=0)
            thr = tl.where(cnt >= k_eff, cand, thr)

    n_gt = 0
    for c in range(NCHUNK):
        keys = _sort_keys(row_logits, c * CHUNK + offs, pos)
        n_gt += tl.sum((keys > thr).to(tl.int32), axis=0)
    ties_wanted = k_eff - n_gt  # >= 1: keys equal to thr, taken in position order

    ties_seen = 0
    emitted = 0
    for c in range(NCHUNK):
        p = c * CHUNK + offs
        keys = _sort_keys(row_logits, p, pos)
        eq = (keys == thr).to(tl.int32)
        eq_rank = ties_seen + tl.cumsum(eq, axis=0)  # 1-based rank among ties so far
        take = (keys > thr) | ((eq == 1) & (eq_rank <= ties_wanted))
        take_i = take.to(tl.int32)
        dst = emitted + tl.cumsum(take_i, axis=0) - 1
        tl.store(out_ptr + row * out_stride + dst, p.to(tl.int64), mask=take)
        ties_seen += tl.sum(eq, axis=0)
        emitted += tl.sum(take_i, axis=0)


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
) -> torch.Tensor:
    """float32 [T, max_len] logits; entries after a row's position are left unwritten."""
    rows, heads, dim = q.shape
    logits = torch.empty(rows, max_len, dtype=torch.float32, device=q.device)
    fp8 = index_k_cache.dtype == torch.uint8
    cache = index_k_cache.contiguous()
    k_scale = cache.view(torch.float32) if fp8 else cache  # scales read as fp32 through this view
    interp = q.device.type != "cuda"
    _logits_kernel[(rows, triton.cdiv(max_len, block_n))](
        q.contiguous().float(), weights.contiguous().float(), kv_slots, row_kv_off, row_pos, cache, k_scale,
        logits, logits.stride(0), heads, softmax_scale, page_size,
        D=dim, BLOCK_H=max(16, triton.next_power_of_2(heads)), BLOCK_N=block_n,
        FP8=fp8, PRECISION="ieee" if interp else "tf32x3", num_warps=4,
    )  # fmt: skip
    return logits


def topk_of_logits(logits: torch.Tensor, row_pos: torch.Tensor, topk: int) -> torch.Tensor:
    """Positions [T, min(topk, L)] of each row's top-k among logits[t, :row_pos[t] + 1]; -1 padded."""
    rows, max_len = logits.shape
    out = torch.full((rows, min(topk, max_len)), -1, dtype=torch.int64, device=logits.device)
    chunk = min(_TOPK_CHUNK, triton.next_power_of_2(max_len))
    _topk_kernel[(rows,)](
        logits, row_pos, out, logits.stride(0), out.stride(0), topk,
        CHUNK=chunk, NCHUNK=triton.cdiv(max_len, chunk), num_warps=16 if chunk >= 4096 else 4,
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
