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
   available where speed matters more than exact ties, and the fp8 query ("fp8", the "_fp8q"
   backends: DeepSeek-V3.2's e4m3 query, fp8 x fp8 products; its reference rounds the query the
   same way, indexer.quantize_query_fp8). Then ReLU, head weights, one logit a key.
2. triton_topk.topk_of_logits: the exact per-row top-k of those logits, emitted in position order.

The per-row metadata (and prompt row blocks) come from the step's IndexerPlan (indexer_plan.py),
built once per forward; without one the backend builds it from the host lists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .indexer_plan import ROWS_PER_BLOCK, IndexerPlan, plan_from_host
from .triton_common import mma_operand
from .triton_topk import topk_of_logits

# Logits programs to aim for (about two per multiprocessor of an H100/H200).
_PROGRAMS_WANTED = 264
# Options of the device path (indexer_topk_rows); bench/kernels/bench_indexer.py times the others.
# fp16x2 with page-contiguous loads: 21.7 us at batch 64, 4K on the H200 (v1's gather, bf16x3: 30.8).
# fold (bench/results/2026-11-29-triton-indexer-v3): 8K prefill logits 1366 -> 1279 us, batch 64 at 4K
# 20.5 -> 19.7 us; chosen sets as the unfolded path's (1 of 8192 prompt rows differs, a near-tie).
# direct (bench/results/2026-12-01-triton-indexer-v4): logits at batch 64, 4K 19.6 -> 18.5 us, 8K
# prefill 1263 -> 1228 us (the fp8 query's 620 -> 560 us). max_span 64 was slower (654 us).
LOGITS_OPTIONS: dict = {"split": "fp16x2", "paged": True, "fold": True, "direct": True}
# Query rows of one request per logits program in prefill (the MMA's N side is this x heads).
PREFILL_ROWS = ROWS_PER_BLOCK
# Logits options for row blocks (prefill), over LOGITS_OPTIONS; and the prefill top-k's warps
# (None: by row length, as for decode; 8 measured no faster, 4 twice as slow at 8K). Rows per
# block: 4 (8 measured 10-25% slower with the fp8 query).
PREFILL_OPTIONS: dict = {}
PREFILL_TOPK_WARPS: int | None = None
# The streamed top-k's piece size for prefill (None: off): on the H200, 8K prompt's top-k alone
# 836 us (sampled, warps by length) -> 586 us streamed in pieces of 1024 keys, 548 us in pieces of
# 512 (4 warps; 2048: 869 us, 689 with 8 warps; 1 or 2 warps a row 1.0-1.4 ms). The whole 8K prompt's
# indexer with pieces of 512: 1770 against 1825 us (fp8 query 1104 against 1150); a 2K prompt the
# same (bench/results/2026-12-01-triton-indexer-v4.md).
PREFILL_TOPK_STREAM: int | None = 512
# Top-k: the fastest on the H200 by batch 1 + batch 64 at 4K (bench/results/2026-11-29-triton-indexer-v2):
# 4-bit digits after the sampled bracket, 11.1 + 14.9 us (8-bit int64, the first version: 15.0 + 16.8).
TOPK_BITS = 4  # digit width of the radix select (triton_topk)
TOPK_SAMPLED = True  # bracket the k-th value with sorted samples before the radix select


@triton.jit
def _load_keys(
    k_ptr, k_scale_ptr, kv_slots_ptr, kv_off, n0, pos, offs_n, valid, offs_d, first,
    D: tl.constexpr, PS: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, ONE_PAGE: tl.constexpr,
    PRELOAD: tl.constexpr,
):  # fmt: skip
    """Keys [BLOCK_N, D] at positions offs_n = n0 + [0, BLOCK_N) of the row's request, valid up to
    position pos (and fp8 scales [BLOCK_N]). PRELOAD: first is the block's first slot, read by the
    caller before its loop (the key loads then depend on no load inside the loop)."""
    if ONE_PAGE:
        # The block lies in one page (positions p of a request live at page * PS + p % PS): one
        # slot lookup for the block, then a contiguous tile of the page.
        # (masked: a block past the row's last key must not read past the request's kv_slots)
        if not PRELOAD:
            first = tl.load(kv_slots_ptr + kv_off + n0, mask=n0 <= pos, other=0)
        page = first.to(tl.int64) // PS
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
        codes = tl.load(k_ptr + (base + off * D)[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        k_scale = tl.load(k_scale_ptr + (base + PS * D) // 4 + off, mask=valid, other=0.0)
        keys = codes.to(tl.float8e4nv, bitcast=True)
    else:
        keys = tl.load(k_ptr + (page * PS + off)[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
        k_scale = keys
    return keys, k_scale


@triton.jit
def _round_e4m3(x):
    """float32 x (|x| < 448) rounded to the nearest e4m3 value (ties to even), kept in float32.
    Integer arithmetic rather than a conversion: bit-exact wherever it runs (Triton 3.6's CPU
    interpreter rounds fp8 conversions near powers of two wrongly), and the fp8 cast that follows
    on the device is then exact."""
    b = x.to(tl.int32, bitcast=True)
    # Normal range: keep 3 mantissa bits (bit 20 is the last one kept: ties go to it being even).
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # Below 2^-6 e4m3 is subnormal: multiples of 2^-9 (adding 1.5 * 2^23 rounds to an integer).
    sub = ((x * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


@triton.jit
def _logits_kernel(
    q_ptr, w_ptr, kv_slots_ptr, row_kv_off_ptr, row_pos_ptr, blk_row0_ptr, blk_rows_ptr,
    k_ptr, k_scale_ptr, out_ptr,
    out_stride, heads, scale, fit,
    D: tl.constexpr, PS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPAN_BLOCKS: tl.constexpr,
    ROWS: tl.constexpr, FP8: tl.constexpr, MODE: tl.constexpr, ONE_PAGE: tl.constexpr, PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr, FOLD: tl.constexpr = False, PRELOAD: tl.constexpr = False,
):  # fmt: skip
    """Logits of ROWS consecutive query rows of one request (ROWS = 1: one row per program, decode;
    more: a prompt chunk's rows share each key tile, the MMA's N side is ROWS x heads).

    MODE 0: 3xTF32 (keys not exact in bf16); 1: q split into three bf16 parts; 2: q split into
    two fp16 parts after a power-of-two scaling (fp8 keys only: e4m3 is exact in fp16); 3: the
    first fp16 part alone (11 significant bits: near-ties may swap at the top-k boundary); 4: q
    rounded to e4m3 per (row, head) with a power-of-two scale, fp8 x fp8 products (fp8 keys only;
    DeepSeek-V3.2's path, indexer.quantize_query_fp8 is its reference).

    FOLD: the positive factors (softmax scale, query scales; the key's fp8 scale after the head
    sum) move out of the ReLU: logit = k_scale * sum_h relu(q_h . k) * (w_h * scale * qscale_h),
    two operations per product instead of five. Mode 4 always folds.

    fit: rows that see at most this many keys (all of the program's rows) get no logits: the top-k
    chooses their whole context without reading any (0: every row gets its logits)."""
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
    if (n_start > pos) | (pos < fit):
        return
    kv_off = tl.load(row_kv_off_ptr + row0)
    cmask = ((offs_c % BLOCK_H) < heads) & ((offs_c // BLOCK_H) < nrows)
    q_row = (row0 + offs_c // BLOCK_H) * heads + offs_c % BLOCK_H
    q = tl.load(q_ptr + q_row[:, None] * D + offs_d[None, :], mask=cmask[:, None], other=0.0)
    w = tl.load(w_ptr + q_row, mask=cmask, other=0.0)
    colscale = tl.full([ROWS * BLOCK_H], 1.0, tl.float32)  # factor of each column's products (FOLD)
    if MODE == 1:
        # fp8 and bf16 keys are exact in bf16, and q = q1 + q2 + q3 exactly with bf16 parts: three
        # bf16 MMAs give float32-exact products (only the summation order differs from fp32).
        q1 = mma_operand(q, INTERPRET)
        r = q - q1.to(tl.float32)
        q2 = mma_operand(r, INTERPRET)
        q3 = mma_operand(r - q2.to(tl.float32), INTERPRET)
    if MODE == 2 or MODE == 3:
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
        colscale = colscale * down
    if MODE == 4:
        # Per (row, head): E = floor(log2(amax)) from the bits; q * 2^(7 - E) has its largest
        # magnitude in [128, 256), inside e4m3's 448; the products are scaled back by 2^(E - 7).
        amax_c = tl.max(tl.abs(q), axis=1)
        e_c = ((amax_c.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e_c = tl.minimum(tl.maximum(e_c, -110), 110)
        q8 = _round_e4m3(q * ((134 - e_c) << 23).to(tl.float32, bitcast=True)[:, None])
        colscale = ((e_c + 120) << 23).to(tl.float32, bitcast=True)
        if not INTERPRET:
            q8 = q8.to(tl.float8e4nv)  # exact: the values are on the e4m3 grid
    if FOLD or MODE == 4:
        w = w * colscale * scale
    offs_b = tl.arange(0, SPAN_BLOCKS)
    firsts = offs_b  # PRELOAD: the first slot of each of the span's blocks
    if PRELOAD:
        n0_b = n_start + offs_b * BLOCK_N
        firsts = tl.load(kv_slots_ptr + kv_off + n0_b, mask=n0_b <= pos, other=0)
    for b in range(SPAN_BLOCKS):
        n0 = n_start + b * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n <= pos
        first = tl.sum(tl.where(offs_b == b, firsts, 0), axis=0)
        keys, k_scale = _load_keys(
            k_ptr, k_scale_ptr, kv_slots_ptr, kv_off, n0, pos, offs_n, valid, offs_d, first,
            D, PS, BLOCK_N, FP8, ONE_PAGE, PRELOAD,
        )  # fmt: skip
        # Keys on the MMA's M side (BLOCK_N rows), heads on N: no padding of a 32-head query to 64.
        if MODE == 1:
            kb = mma_operand(keys, INTERPRET)
            s = tl.dot(kb, tl.trans(q1)) + tl.dot(kb, tl.trans(q2)) + tl.dot(kb, tl.trans(q3))
        elif MODE == 2 or MODE == 3:
            kh = keys.to(tl.float16)
            if INTERPRET:
                kh = kh.to(tl.float32)
            s = tl.dot(kh, tl.trans(q1))
            if MODE == 2:
                s += tl.dot(kh, tl.trans(q2)) * (1.0 / 2048.0)
        elif MODE == 4:
            if INTERPRET:
                s = tl.dot(keys.to(tl.float32), tl.trans(q8), input_precision="ieee")
            else:
                s = tl.dot(keys, tl.trans(q8))
        else:
            s = tl.dot(keys.to(tl.float32), tl.trans(q), input_precision=PRECISION)  # [BLOCK_N, ROWS * BLOCK_H]
        if FOLD or MODE == 4:
            s = tl.maximum(s, 0.0) * w[None, :]
        else:
            if MODE == 2 or MODE == 3:
                s = s * down
            if FP8:
                s = s * k_scale[:, None]
            s = tl.maximum(s * scale, 0.0) * w[None, :]
        if ROWS == 1:
            logit1 = tl.sum(s, axis=1)
            if FP8 and (FOLD or MODE == 4):
                logit1 = logit1 * k_scale
            tl.store(out_ptr + row0 * out_stride + offs_n, logit1, mask=valid)
        else:
            logit = tl.sum(tl.reshape(s, [BLOCK_N, ROWS, BLOCK_H]), axis=2)  # [BLOCK_N, ROWS]
            if FP8 and (FOLD or MODE == 4):
                logit = logit * k_scale[:, None]
            ptrs = out_ptr + (row0 + offs_j)[None, :].to(tl.int64) * out_stride + offs_n[:, None]
            tl.store(ptrs, logit, mask=(offs_n[:, None] <= pos_j[None, :]) & (offs_j[None, :] < nrows))


def row_metadata(
    query_start: list[int], cached_lens: list[int], seq_lens: list[int], device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row: offset of its request in kv_slots, and its own (last visible) position."""
    plan = plan_from_host(query_start, cached_lens, seq_lens, device)
    return plan.row_kv_off, plan.row_pos


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
    fold: bool = False,
    direct: bool = False,
    max_span: int = 16,
    skip_fit: int = 0,
) -> torch.Tensor:
    """float32 [T, max_len] logits; entries after a row's position are left unwritten, and so are
    the rows that see at most skip_fit keys (0: none), whose top-k is their whole context whatever
    the logits (indexer_topk_rows passes the top-k: in a decode step where one request's context
    passes it, the others' rows cost nothing).

    paged: kv_slots are page-aligned (position p of a request at page * page_size + p % page_size,
    as the worker builds them), so a block of keys within one page is one contiguous load.
    split: how the float32 query meets fp8/bf16 keys on the tensor cores, "bf16x3" or (fp8 keys
    only) "fp16x2", both float32-accurate; or (fp8 keys only) "fp16", one pass, not exact; or (fp8
    keys only) "fp8": the query rounded to e4m3 per (row, head), fp8 x fp8 products, as
    indexer.quantize_query_fp8 (other caches: "fp8" means the exact split).
    fold: ReLU-positive factors applied to the head weights, the key scale after the head sum.
    direct: (paged, on the GPU) fp8 codes through an fp8-typed pointer and each span's block slots
    read before the block loop: the pipelined key tiles then go from shared memory straight into
    an fp8 MMA (no register round trip; sm_90 TTGIR has no local_load for them).
    max_span: most key blocks a program reads (its query rows are loaded, and split or quantised,
    once per program: prompt rows re-read the float32 query once per span).
    row_blocks: (first row int32 [NB], row count int32 [NB], ROWS): blocks of up to ROWS
    consecutive query rows of one request that share key tiles (prefill); None: a row per program."""
    rows, heads, dim = q.shape
    # Rows padded to a multiple of 16 floats: the row stride is then always 16-divisible, so the
    # logits and top-k kernels compile once for it (and keep their vector loads) at every length.
    logits = torch.empty(rows, -(-max_len // 16) * 16, dtype=torch.float32, device=q.device)[:, :max_len]
    fp8 = index_k_cache.dtype == torch.uint8
    cache = index_k_cache.contiguous()
    k_scale = cache.view(torch.float32) if fp8 else cache  # scales read as fp32 through this view
    interp = q.device.type != "cuda"
    one_page = paged and page_size % block_n == 0
    if direct and fp8 and not interp:
        cache = cache.view(torch.float8_e4m3fn)
    blocks = triton.cdiv(max_len, block_n)
    if row_blocks is None:
        blk_row0 = blk_rows = row_pos
        n_row_blocks, rows_per = rows, 1
    else:
        blk_row0, blk_rows, rows_per = row_blocks
        n_row_blocks = blk_row0.shape[0]
    # Several key blocks per program (the query is loaded once, the gathers pipelined), but enough
    # programs for about two per multiprocessor.
    span = max(1, min(max_span, blocks * n_row_blocks // (programs_wanted or _PROGRAMS_WANTED)))
    span = 1 << (span.bit_length() - 1)  # a power of two: few distinct compiled variants
    if fp8 and split in ("fp16x2", "fp16", "fp8"):
        mode = {"fp16x2": 2, "fp16": 3, "fp8": 4}[split]
        assert mode != 4 or dim <= 128, "one query scale per head: head_dim <= 128"
    else:
        mode = 1 if fp8 or cache.dtype == torch.bfloat16 else 0
    _logits_kernel[(n_row_blocks, triton.cdiv(blocks, span))](
        q.contiguous().float(), weights.contiguous().float(), kv_slots, row_kv_off, row_pos, blk_row0, blk_rows,
        cache, k_scale, logits, logits.stride(0), heads, softmax_scale, skip_fit,
        D=dim, PS=page_size, BLOCK_H=max(16, triton.next_power_of_2(heads)), BLOCK_N=block_n, SPAN_BLOCKS=span,
        ROWS=rows_per, FP8=fp8, MODE=mode, ONE_PAGE=one_page, PRECISION="ieee" if interp else "tf32x3",
        INTERPRET=interp, FOLD=fold, PRELOAD=direct and one_page, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return logits


def indexer_topk_rows(
    q, weights, index_k_cache, kv_slots, row_kv_off, row_pos, max_len, topk, softmax_scale, page_size, blocks=None,
    query: str | None = None,
):  # fmt: skip
    """Device-only part (no host sync, CUDA-graph capturable): logical positions [T, min(topk, max_len)].

    query: None (LOGITS_OPTIONS' split) or "fp8" (the query rounded to fp8 against an fp8 cache)."""
    if q.shape[0] == 0 or max_len == 0 or topk == 0:
        return torch.full((q.shape[0], min(topk, max_len)), -1, dtype=torch.int64, device=q.device)
    opts = dict(LOGITS_OPTIONS)
    if blocks is not None:
        opts.update(PREFILL_OPTIONS)
    if query == "fp8" and index_k_cache.dtype == torch.uint8:
        opts["split"] = "fp8"
    logits = indexer_logits(
        q, weights, index_k_cache, kv_slots, row_kv_off, row_pos, max_len, softmax_scale, page_size,
        row_blocks=blocks, skip_fit=topk, **opts,
    )  # fmt: skip
    warps = PREFILL_TOPK_WARPS if blocks is not None else None
    stream = PREFILL_TOPK_STREAM if blocks is not None else None
    return topk_of_logits(logits, row_pos, topk, num_warps=warps, bits=TOPK_BITS, sampled=TOPK_SAMPLED, stream=stream)


def indexer_topk_rows_fp8q(*args, **kwargs):
    """The registry's ("indexer_rows", "triton_fp8q"): indexer_topk_rows with the fp8 query."""
    return indexer_topk_rows(*args, **kwargs, query="fp8")


def indexer_topk_triton(
    q, weights, index_k_cache, kv_slots, query_start, cached_lens, seq_lens, topk, softmax_scale, page_size,
    plan: IndexerPlan | None = None, query: str | None = None,
) -> torch.Tensor:  # fmt: skip
    """The registry's ("indexer", "triton") backend: same arguments as indexer_topk_torch.

    plan: the step's row metadata (StepMeta.indexer, built once per forward); without one it is
    built here from the host lists."""
    if plan is None:
        plan = plan_from_host(query_start, cached_lens, seq_lens, q.device)
    return indexer_topk_rows(
        q, weights, index_k_cache, kv_slots, plan.row_kv_off, plan.row_pos, plan.max_len, topk,
        softmax_scale, page_size, plan.blocks, query=query,
    )  # fmt: skip


def indexer_topk_triton_fp8q(*args, **kwargs):
    """The registry's ("indexer", "triton_fp8q"): the query rounded to fp8 against an fp8 cache."""
    return indexer_topk_triton(*args, **kwargs, query="fp8")
