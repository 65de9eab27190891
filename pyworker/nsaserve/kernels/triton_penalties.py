"""Triton "penalties" backend: repetition, frequency and presence penalties in one launch.

The torch reference (penalties.py, which defines the arguments) expands every penalised row's history into (row, token) pairs
and sorts them to find each distinct pair and its count: about fifty small launches, which at one
or a few rows cost the worker's launch more host time than the step's device work (H200, one
row of 1,400 tokens with every sampling feature: 3.8 ms of launch against 2.9 ms of device).

Here one program per penalised row walks the row's history (the plan's flat history array, read
through the row's start and length, plus the token the pipelined worker appends) in five phases,
each over the whole history, separated by barriers (all entries of a row belong to its program,
so a barrier orders them):

  1. save     each entry's current logit into a per-entry scratch;
  2. zero     the logit of each entry's token (the row's logits serve as the count buffer);
  3. count    atomically add 1 there for each generated entry;
  4. compute  each entry's penalised value from its saved logit and its token's count;
  5. write    the value back (entries of one token write the same value).

Every output is a pure function of its token's original logit and count, as in the reference, and
the arithmetic is rounded as torch's (division correctly rounded, no fused multiply-add), so the
result is bit-identical to the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # history entries per loop step


@triton.jit
def _mul_rn(a, b, INTERPRET: tl.constexpr):
    """a * b rounded on its own (never contracted into a fused multiply-add, as torch's separate
    kernels compute it)."""
    if INTERPRET:
        return a * b
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _entry_tokens(hist_ptr, start, n, pending, j):
    """The tokens of entries j (int64): history[start + j] for j < n, the pending token at j == n."""
    tok = tl.load(hist_ptr + start + j, mask=j < n, other=-1).to(tl.int64)
    return tl.where(j == n, pending, tok)


@triton.jit(do_not_specialize=["vocab"])
def _penalties_kernel(
    out_ptr, save_ptr, hist_ptr, rows_ptr, start_ptr, len_ptr, prompt_ptr, pending_ptr, first_ptr,
    rep_ptr, freq_ptr, pres_ptr, vocab,
    BLOCK: tl.constexpr, STEPS: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    row = tl.load(rows_ptr + p)
    start = tl.load(start_ptr + p)
    n = tl.load(len_ptr + p)
    prompt = tl.load(prompt_ptr + p)
    pending = tl.load(pending_ptr + p)
    entries = n + (pending >= 0).to(n.dtype)
    first = tl.load(first_ptr + p)  # this row's first slot in the per-entry scratch
    rep = tl.load(rep_ptr + row)
    freq = tl.load(freq_ptr + row)
    pres = tl.load(pres_ptr + row)
    base = out_ptr + row.to(tl.int64) * vocab
    lanes = tl.arange(0, BLOCK)
    # Triton's CPU interpreter loops only over compile-time counts (STEPS there).
    for s in range(STEPS if INTERPRET else tl.cdiv(entries, BLOCK)):  # 1. save
        j = s * BLOCK + lanes
        tok = _entry_tokens(hist_ptr, start, n, pending, j)
        ok = (j < entries) & (tok >= 0) & (tok < vocab)
        tl.store(save_ptr + first + j, tl.load(base + tok, mask=ok, other=0.0), mask=j < entries)
    tl.debug_barrier()
    for s in range(STEPS if INTERPRET else tl.cdiv(entries, BLOCK)):  # 2. zero
        j = s * BLOCK + lanes
        tok = _entry_tokens(hist_ptr, start, n, pending, j)
        tl.store(base + tok, tl.zeros([BLOCK], tl.float32), mask=(j < entries) & (tok >= 0) & (tok < vocab))
    tl.debug_barrier()
    for s in range(STEPS if INTERPRET else tl.cdiv(entries, BLOCK)):  # 3. count the generated entries
        j = s * BLOCK + lanes
        tok = _entry_tokens(hist_ptr, start, n, pending, j)
        ok = (j < entries) & (tok >= 0) & (tok < vocab) & (j >= prompt)
        tl.atomic_add(base + tok, tl.full([BLOCK], 1.0, tl.float32), mask=ok, sem="relaxed")
    tl.debug_barrier()
    for s in range(STEPS if INTERPRET else tl.cdiv(entries, BLOCK)):  # 4. compute
        j = s * BLOCK + lanes
        tok = _entry_tokens(hist_ptr, start, n, pending, j)
        ok = (j < entries) & (tok >= 0) & (tok < vocab)
        # The counts were made by atomics, which happen in L2: read them there (".cg"), never
        # from a line this multiprocessor's L1 kept from the save phase.
        count = tl.load(base + tok, mask=ok, other=0.0, cache_modifier=".cg")
        x = tl.load(save_ptr + first + j, mask=j < entries, other=0.0)
        x = tl.where(x > 0, tl.math.div_rn(x, rep), _mul_rn(x, rep, INTERPRET))
        x = x - (_mul_rn(freq, count, INTERPRET) + _mul_rn(pres, (count > 0).to(tl.float32), INTERPRET))
        tl.store(save_ptr + first + j, x, mask=j < entries)
    tl.debug_barrier()
    for s in range(STEPS if INTERPRET else tl.cdiv(entries, BLOCK)):  # 5. write
        j = s * BLOCK + lanes
        tok = _entry_tokens(hist_ptr, start, n, pending, j)
        ok = (j < entries) & (tok >= 0) & (tok < vocab)
        tl.store(base + tok, tl.load(save_ptr + first + j, mask=j < entries, other=0.0), mask=ok)


def penalties_triton(
    flat, vocab, history, rows, start, length, prompt_len, pending, first, rep, freq, pres, history_entries, max_length
) -> None:
    """The registry's ("penalties", "triton") backend: same arguments as penalties_torch."""
    P = rows.numel()
    if P == 0:
        return
    save = torch.empty(history_entries + P, dtype=torch.float32, device=flat.device)
    hist = history if history.numel() else save.new_zeros(1, dtype=torch.int64)
    interp = flat.device.type != "cuda"
    _penalties_kernel[(P,)](
        flat, save, hist, rows, start, length, prompt_len, pending, first, rep, freq, pres, vocab,
        BLOCK=BLOCK, STEPS=triton.cdiv(max_length + 1, BLOCK) if interp else 0, INTERPRET=interp, num_warps=4,
    )  # fmt: skip
