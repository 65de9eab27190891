"""Triton "sample_threshold" backend: top-k / top-p / min-p thresholds without sorting a row.

The reference sorts [S, V] float32 (V = 154,880 for GLM-5): several milliseconds at 1024 rows.
Here each row takes a few streaming passes and a search over the few values that matter:

1. max    (row, piece): the largest y = x / T of each piece of the row (and smallest finite).
2. ladder (row, piece): count and mass (sum of exp(y - max)) of the values at or above each of
   LADDER thresholds max - D_j (D_0 = 0, then 2^-2 ... 2^4.5, the last the row's smallest value).
3. bracket (row): the ladder step holding the first criterion's answer (top-k's k-th value, else
   top-p's cut): its edges lo and hi, and each piece's offset for the collect.
   2-3 again (REFINEMENTS times) for the rows whose step holds more than CAP values, LADDER - 1
   even steps between lo and hi (a no-op launch for the others).
4. collect (row, piece): when at most CAP values lie in the scratch's range, they are copied to
   a per-row scratch buffer, so the search reads CAP values instead of the row. The range is the
   step, lo <= y < hi, for top-p rows (the count and mass above hi are offsets: a flat row's
   nucleus can hold most of the vocabulary), and y >= lo for top-k rows (the top-p search
   inside the top-k set reads the whole set).
5. finish (row): bisection on the values' order-preserving integer keys, LADDER - 1 probes a
   pass, over the scratch (or the row when too many values tie near the cut): top-k's value,
   then top-p's inside the top-k set, then min-p's closed form; the row's threshold is their max.

Every count is exact, so top-k and min-p equal the reference's bit for bit; top-p's masses are
float32 sums in another order than the reference's, so a cut within rounding of top_p may differ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LADDER = 16  # thresholds per pass (the ladder's, and the bisection's probes + 1)
CAP = 4096  # the most values a row's scratch holds
REFINEMENTS = 2  # ladder passes after the first, for rows whose step holds more than CAP values
BLOCK = 8192  # values per loop step of the streaming passes (max, collect)
TALLY_BLOCK = 512  # values per loop step where each meets LADDER thresholds
PROGRAMS_WANTED = 264  # two per multiprocessor of an H100/H200
MIN_PIECE = 8192  # the shortest piece of a row one program streams
# The same sizes as the kernels see them (a kernel reads module globals only as constexprs).
_LADDER = tl.constexpr(LADDER)
_BLOCK = tl.constexpr(BLOCK)
_TALLY_BLOCK = tl.constexpr(TALLY_BLOCK)


@triton.jit
def _key(y):
    """float32 -> int32 in the same order (-0.0 is made +0.0 first, as they compare equal)."""
    b = tl.where(y == 0.0, 0.0, y).to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _from_key(k):
    k = k.to(tl.int32)
    return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _load_y(ptr, offs, ok, temp):
    """The processed logits y = raw logits / temperature, correctly rounded as torch's division
    (the scratch holds raw logits too). -inf where `ok` is false."""
    y = tl.load(ptr + offs, mask=ok, other=float("-inf")).to(tl.float32)
    return tl.math.div_rn(y, temp)


@triton.jit
def _tally(ptr, n, temp, top, probe, want_mass, STEPS: tl.constexpr, INTERPRET: tl.constexpr):
    """For each probe key c (int32 [LADDER]): how many of the n values have key >= c, and (when
    want_mass) their mass sum(exp(y - top)); zeros otherwise.

    Probes along dim 0 and values along dim 1 of a [LADDER, TALLY_BLOCK] step: Triton's default
    layout then spreads the values over threads and keeps every probe of a value in its thread
    (values along dim 0 put the probes across threads, each thread recomputing its values' y,
    exp and key: 3.6x slower at 1024 rows). Per-thread sums across the loop, one reduction at
    the end."""
    lanes = tl.arange(0, _TALLY_BLOCK)
    c = probe[:, None]
    count = tl.zeros([_LADDER, _TALLY_BLOCK], tl.int32)
    mass = tl.zeros([_LADDER, _TALLY_BLOCK], tl.float32)
    if want_mass:
        for b in range(STEPS if INTERPRET else tl.cdiv(n, _TALLY_BLOCK)):
            offs = b * _TALLY_BLOCK + lanes
            ok = offs < n
            y = _load_y(ptr, offs, ok, temp)
            hit = (_key(y)[None, :] >= c) & ok[None, :]
            count += hit.to(tl.int32)
            mass += tl.where(hit, tl.exp(y - top)[None, :], 0.0)
    else:  # counts alone: half the work a value
        for b in range(STEPS if INTERPRET else tl.cdiv(n, _TALLY_BLOCK)):
            offs = b * _TALLY_BLOCK + lanes
            ok = offs < n
            hit = (_key(_load_y(ptr, offs, ok, temp))[None, :] >= c) & ok[None, :]
            count += hit.to(tl.int32)
    return tl.sum(count, axis=1), tl.sum(mass, axis=1)


@triton.jit
def _filters(topk_ptr, topp_ptr, log_minp_ptr, row, vocab):
    k = tl.load(topk_ptr + row)
    p = tl.load(topp_ptr + row)
    log_mp = tl.load(log_minp_ptr + row)  # taken by torch: -inf when min-p is off
    return k, p, log_mp, (k > 0) & (k < vocab), p < 1.0, log_mp > float("-inf")


@triton.jit
def _row_top(pmax_ptr, row, pieces, PIECES: tl.constexpr):
    i = tl.arange(0, PIECES)
    return tl.max(tl.load(pmax_ptr + row * PIECES + i, mask=i < pieces, other=float("-inf")), axis=0)


@triton.jit(do_not_specialize=["piece"])
def _max_kernel(
    x_ptr, temp_ptr, topk_ptr, topp_ptr, log_minp_ptr, pmax_ptr, pmin_ptr, vocab, stride_x, piece,
    PIECES: tl.constexpr, STEPS: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The largest y of each piece, and its smallest finite one (+inf: none)."""
    row = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    k, p, mp, k_on, p_on, m_on = _filters(topk_ptr, topp_ptr, log_minp_ptr, row, vocab)
    best = tl.full([_BLOCK], float("-inf"), tl.float32)
    least = tl.full([_BLOCK], float("inf"), tl.float32)
    if k_on | p_on | m_on:
        temp = tl.load(temp_ptr + row)
        start = pid * piece
        n = tl.minimum(piece, vocab - start)
        lanes = tl.arange(0, _BLOCK)
        for b in range(STEPS if INTERPRET else tl.cdiv(n, _BLOCK)):
            offs = b * _BLOCK + lanes
            y = _load_y(x_ptr + row * stride_x + start, offs, offs < n, temp)
            best = tl.maximum(best, y)
            least = tl.minimum(least, tl.where(y == float("-inf"), float("inf"), y))
    tl.store(pmax_ptr + row * PIECES + pid, tl.max(best, axis=0))
    tl.store(pmin_ptr + row * PIECES + pid, tl.min(least, axis=0))


@triton.jit
def _row_least(pmin_ptr, row, pieces, PIECES: tl.constexpr):
    i = tl.arange(0, PIECES)
    return tl.min(tl.load(pmin_ptr + row * PIECES + i, mask=i < pieces, other=float("inf")), axis=0)


@triton.jit
def _probes(top, least, info, REFINE: tl.constexpr):
    """The thresholds t_j (j = 0..LADDER-1, descending) of a ladder pass, and their keys.

    First pass: top - D_j, D = 0, 2^(-2), 2^(-1.5), ..., 2^4.5, then the row's smallest finite
    value (the last step holds every finite value). Refinement: the current step's hi, then
    LADDER - 1 even steps down to its lo (the last = lo), so that the counts and masses at or
    above every new step's upper edge come from this pass too."""
    j = tl.arange(0, _LADDER)
    if REFINE:
        lo = tl.load(info + 1)
        hi = tl.load(info + 2)
        t = hi - (hi - lo) * (j.to(tl.float32) / (_LADDER - 1))
        t = tl.where(j == 0, hi, tl.where(j == _LADDER - 1, lo, t))
    else:
        t = top - tl.where(j == 0, 0.0, tl.exp2((j - 5).to(tl.float32) * 0.5))
        t = tl.where(j == _LADDER - 1, tl.minimum(least, top), t)
    return j, _key(t), t


@triton.jit
def _needs_pass(info, k_on, p_on, CAP: tl.constexpr, REFINE: tl.constexpr):
    """Rows a ladder pass works on: all with top-k or top-p; a refinement only those whose step
    holds more values than the scratch (info[3]: see _bracket_kernel)."""
    if REFINE:
        return (k_on | p_on) & (tl.load(info + 0) > 0) & (tl.load(info + 3) > CAP)
    return k_on | p_on


@triton.jit(do_not_specialize=["piece"])
def _ladder_kernel(
    x_ptr, temp_ptr, topk_ptr, topp_ptr, log_minp_ptr, pmax_ptr, pmin_ptr, info_ptr, count_ptr, mass_ptr, vocab,
    stride_x, piece,
    CAP: tl.constexpr, REFINE: tl.constexpr, PIECES: tl.constexpr, STEPS: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    k, p, mp, k_on, p_on, m_on = _filters(topk_ptr, topp_ptr, log_minp_ptr, row, vocab)
    info = info_ptr + row * 8
    if _needs_pass(info, k_on, p_on, CAP, REFINE):
        temp = tl.load(temp_ptr + row)
        top = _row_top(pmax_ptr, row, tl.num_programs(1), PIECES)
        j, probe, t = _probes(top, _row_least(pmin_ptr, row, tl.num_programs(1), PIECES), info, REFINE)
        start = pid * piece
        # Top-k rows bracket by counts alone (their set's mass is taken over the scratch later).
        count, mass = _tally(
            x_ptr + row * stride_x + start, tl.minimum(piece, vocab - start), temp, top, probe, p_on & ~k_on, STEPS,
            INTERPRET,
        )
        out = (row * PIECES + pid) * _LADDER + j
        tl.store(count_ptr + out, count)
        tl.store(mass_ptr + out, mass)


@triton.jit(do_not_specialize=["pieces"])
def _bracket_kernel(
    topk_ptr, topp_ptr, log_minp_ptr, pmax_ptr, pmin_ptr, count_ptr, mass_ptr, info_ptr, base_ptr, vocab, pieces,
    CAP: tl.constexpr, REFINE: tl.constexpr, PIECES: tl.constexpr,
):  # fmt: skip
    """Per row: the ladder step [lo, hi) holding the first criterion's answer (top-k's, else
    top-p's) and, for the collect, each piece's offset in the scratch.

    What the scratch holds: for top-k rows every value >= lo (the top-p search inside the top-k
    set needs them all, and k keeps them few); for top-p rows without top-k only the step's
    values, lo <= y < hi, with the count and mass of those >= hi carried as offsets (a large
    nucleus, as flat logits give, would not fit otherwise).
    info = (step, lo, hi, the scratch's count, the mass >= hi, Z: the mass of the whole row
    (masses: top-p rows without top-k only), the answer when step is 0: the maximum or -inf for
    a top-k beyond the row's finite values, the count >= hi (0 for top-k rows))."""
    row = tl.program_id(0).to(tl.int64)
    k, p, mp, k_on, p_on, m_on = _filters(topk_ptr, topp_ptr, log_minp_ptr, row, vocab)
    info = info_ptr + row * 8
    if _needs_pass(info, k_on, p_on, CAP, REFINE):
        top = _row_top(pmax_ptr, row, pieces, PIECES)
        j, probe, t = _probes(top, _row_least(pmin_ptr, row, pieces, PIECES), info, REFINE)
        pc = tl.arange(0, PIECES)
        tile = (row * PIECES + pc[:, None]) * _LADDER + j[None, :]
        counts = tl.load(count_ptr + tile, mask=pc[:, None] < pieces, other=0)
        masses = tl.load(mass_ptr + tile, mask=pc[:, None] < pieces, other=0.0)
        count = tl.sum(counts, axis=0)
        mass = tl.sum(masses, axis=0)
        if REFINE:
            total = tl.load(info + 5)
        else:
            total = tl.sum(tl.where(j == _LADDER - 1, mass, 0.0), axis=0)
        met = tl.where(k_on, count >= k, mass >= p * total)
        # The last step holds the answer, unless top-k asks for more values than are finite.
        beyond = k_on & (tl.sum(tl.where(j == _LADDER - 1, count, 0), axis=0) < k)
        step = tl.min(tl.where(met, j, _LADDER - 1), axis=0)
        step = tl.where(beyond, 0, step)
        # Step 0 of the first pass needs no search (its answer is info[6]). A refinement's probe 0
        # is the current hi, which did not meet the goal before (rounding aside): its step >= 1.
        if REFINE:
            step = tl.maximum(step, 1)
        else:
            tl.store(info + 6, tl.where(beyond, float("-inf"), top))
        at = j == step
        # Top-k rows leave nothing out above hi. (`!= 0`: Triton's interpreter cannot `&` a bool
        # vector with a scalar comparison's result.)
        above = (j == step - 1) & ((p_on & ~k_on) != 0)
        lo = tl.sum(tl.where(at, t, 0.0), axis=0)
        hi = tl.where(step == 0, top, tl.sum(tl.where(j == step - 1, t, 0.0), axis=0))
        n_above = tl.sum(tl.where(above, count, 0), axis=0)
        tl.store(info + 0, step.to(tl.float32))
        tl.store(info + 1, lo)
        tl.store(info + 2, hi)
        tl.store(info + 3, (tl.sum(tl.where(at, count, 0), axis=0) - n_above).to(tl.float32))
        tl.store(info + 4, tl.sum(tl.where(above, mass, 0.0), axis=0))
        tl.store(info + 5, total)
        tl.store(info + 7, n_above.to(tl.float32))
        # Each piece's values in the scratch's range go after the earlier pieces' ones.
        per_piece = tl.sum(tl.where(at[None, :], counts, 0), axis=1) - tl.sum(tl.where(above[None, :], counts, 0), axis=1)
        tl.store(base_ptr + row * PIECES + pc, tl.cumsum(per_piece, axis=0) - per_piece, mask=pc < pieces)


@triton.jit(do_not_specialize=["piece"])
def _collect_kernel(
    x_ptr, temp_ptr, topk_ptr, topp_ptr, log_minp_ptr, info_ptr, base_ptr, scratch_ptr, vocab, stride_x, piece,
    CAP: tl.constexpr, PIECES: tl.constexpr, STEPS: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    k, p, mp, k_on, p_on, m_on = _filters(topk_ptr, topp_ptr, log_minp_ptr, row, vocab)
    if k_on | p_on:
        info = info_ptr + row * 8
        step = tl.load(info + 0)
        n_in = tl.load(info + 3)
        if (step > 0) & (n_in <= CAP):
            temp = tl.load(temp_ptr + row)
            # The scratch's range in keys (as the ladder's tally compares): [lo, hi) for top-p
            # rows without top-k, [lo, anything) for top-k rows.
            k_lo = _key(tl.load(info + 1))
            k_hi = tl.where(k_on, 0x7FFFFFFF, _key(tl.load(info + 2)))
            start = pid * piece
            n = tl.minimum(piece, vocab - start)
            at = tl.load(base_ptr + row * PIECES + pid)
            lanes = tl.arange(0, _BLOCK)
            for b in range(STEPS if INTERPRET else tl.cdiv(n, _BLOCK)):
                offs = b * _BLOCK + lanes
                raw = tl.load(x_ptr + row * stride_x + start + offs, mask=offs < n, other=float("-inf"))
                key = _key(tl.math.div_rn(raw.to(tl.float32), temp))
                keep = (key >= k_lo) & (key < k_hi) & (offs < n)
                hits = tl.sum(keep.to(tl.int32), axis=0)
                if hits > 0:  # most blocks hold none: no scan there
                    slot = at + tl.cumsum(keep.to(tl.int32), axis=0) - 1
                    tl.store(scratch_ptr + row * CAP + slot, raw, mask=keep)
                    at += hits


@triton.jit
def _search(ptr, n, temp, top, klo, khi, by_mass, goal_count, goal_mass, STEPS: tl.constexpr,
            INTERPRET: tl.constexpr):  # fmt: skip
    """The largest key c with f(c) >= goal, f(c) = the count (by_mass: the mass) of the n values
    with key >= c, given f(klo) >= goal > f(khi): bisection, LADDER - 1 probes a pass."""
    j = tl.arange(0, _LADDER)
    while khi - klo > 1:
        width = (khi - klo + _LADDER - 1) // _LADDER
        probe = klo + width * (j + 1)
        inside = (probe < khi) & (j < _LADDER - 1)
        count, mass = _tally(ptr, n, temp, top, tl.minimum(probe, khi).to(tl.int32), by_mass, STEPS, INTERPRET)
        met = inside & tl.where(by_mass, mass >= goal_mass, count >= goal_count)
        new_lo = tl.max(tl.where(met, probe, klo), axis=0)
        khi = tl.min(tl.where(inside & ~met, probe, khi), axis=0)
        klo = new_lo
    return klo


@triton.jit(do_not_specialize=["pieces"])
def _finish_kernel(
    x_ptr, temp_ptr, topk_ptr, topp_ptr, log_minp_ptr, pmax_ptr, info_ptr, scratch_ptr, th_ptr, vocab, stride_x, pieces,
    CAP: tl.constexpr, PIECES: tl.constexpr, STEPS: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    k, p, mp, k_on, p_on, m_on = _filters(topk_ptr, topp_ptr, log_minp_ptr, row, vocab)
    th = tl.full([], float("-inf"), tl.float32)
    top = _row_top(pmax_ptr, row, pieces, PIECES)
    if k_on | p_on:
        temp = tl.load(temp_ptr + row)
        info = info_ptr + row * 8
        step = tl.load(info + 0)
        n_in = tl.load(info + 3)
        # The search reads the scratch's copies when the ladder step's values fit there, else the
        # row; over the scratch, the values above it (top-p rows without top-k) count as offsets.
        in_scratch = (step > 0) & (n_in <= CAP)  # as the collect decided
        src = tl.where(in_scratch, scratch_ptr + row * CAP, x_ptr + row * stride_x)
        n = tl.where(in_scratch, n_in.to(tl.int32), vocab)
        n_above = tl.where(in_scratch, tl.load(info + 7), 0.0).to(tl.int64)
        mass_above = tl.where(in_scratch, tl.load(info + 4), 0.0)
        # The first criterion (top-k's, else top-p's) inside its ladder step [lo, hi); at step 0
        # no search (info[6]: the maximum, or -inf for a top-k beyond the finite values).
        first = tl.load(info + 6)
        if step > 0:
            klo = _key(tl.load(info + 1)).to(tl.int64)
            khi = _key(tl.load(info + 2)).to(tl.int64)
            goal = p * tl.load(info + 5) - mass_above
            first = _from_key(_search(src, n, temp, top, klo, khi, not k_on, k - n_above, goal, STEPS, INTERPRET))
        th = first
        # top-p inside the top-k set, between its k-th value and the maximum (nothing to do when
        # the set is the maximum's ties): the set's mass first, then the cut. A goal of 0
        # (top_p <= 0) keeps only the maximum.
        if k_on & p_on & (first < top):
            at_first = _key(first) + tl.zeros([_LADDER], tl.int32)
            set_mass = tl.max(_tally(src, n, temp, top, at_first, True, STEPS, INTERPRET)[1], axis=0)
            goal = p * set_mass
            pth = top
            if goal > 0.0:
                klo = _key(first).to(tl.int64)
                khi = _key(top).to(tl.int64) + 1
                pth = _from_key(_search(src, n, temp, top, klo, khi, True, k, goal, STEPS, INTERPRET))
            th = tl.maximum(th, pth)
    if m_on:
        th = tl.maximum(th, top + mp)
    tl.store(th_ptr + row, th)


def pieces_for(rows: int, vocab: int) -> int:
    """Pieces per row for the streaming passes: enough programs for the GPU, none shorter than
    MIN_PIECE values."""
    want = max(1, -(-PROGRAMS_WANTED // max(rows, 1)))
    return max(1, min(want, vocab // MIN_PIECE))


def max_pieces(vocab: int) -> int:
    """The per-row arrays' width (a compile-time size): by the vocabulary alone, so that no batch
    size compiles a variant of its own."""
    return triton.next_power_of_2(max(1, vocab // MIN_PIECE))


def sample_threshold_triton(
    x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """The registry's ("sample_threshold", "triton") backend: same arguments as sample_threshold_torch."""
    rows, vocab = x.shape
    th = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return th
    x = x if x.stride(1) == 1 else x.contiguous()
    f32 = dict(dtype=torch.float32, device=x.device)
    temp, top_p, min_p = (t.to(**f32).contiguous() for t in (temperature, top_p, min_p))
    # The kernels take log(min_p) from torch (the reference's cut, max + log(min_p), bit for bit).
    min_p = min_p.log()
    top_k = top_k.to(device=x.device, dtype=torch.int64).contiguous()
    pieces = pieces_for(rows, vocab)
    piece = triton.cdiv(triton.cdiv(vocab, pieces), BLOCK) * BLOCK
    pieces = triton.cdiv(vocab, piece)
    P = max_pieces(vocab)
    pmax = torch.empty(rows, P, **f32)
    pmin = torch.empty(rows, P, **f32)
    count = torch.empty(rows, P, LADDER, dtype=torch.int32, device=x.device)
    mass = torch.empty(rows, P, LADDER, **f32)
    info = torch.empty(rows, 8, **f32)  # per row: see _bracket_kernel
    base = torch.empty(rows, P, dtype=torch.int32, device=x.device)
    scratch = torch.empty(rows, CAP, dtype=x.dtype, device=x.device)  # raw logits: one load path
    interp = x.device.type != "cuda"
    steps = (lambda block, n: triton.cdiv(n, block) if interp else 0)  # noqa: E731
    filt = (temp, top_k, top_p, min_p)
    _max_kernel[(rows, pieces)](
        x, *filt, pmax, pmin, vocab, x.stride(0), piece, PIECES=P, STEPS=steps(BLOCK, piece), INTERPRET=interp, num_warps=8
    )
    # The first ladder, then refinements of the rows whose step holds more values than the
    # scratch (each cuts a step into LADDER; rows already settled return at once).
    for refine in range(1 + REFINEMENTS):
        _ladder_kernel[(rows, pieces)](
            x, *filt, pmax, pmin, info, count, mass, vocab, x.stride(0), piece,
            CAP=CAP, REFINE=refine > 0, PIECES=P, STEPS=steps(TALLY_BLOCK, piece), INTERPRET=interp, num_warps=8,
        )  # fmt: skip
        _bracket_kernel[(rows,)](
            *filt[1:], pmax, pmin, count, mass, info, base, vocab, pieces, CAP=CAP, REFINE=refine > 0, PIECES=P,
            num_warps=1,
        )
    _collect_kernel[(rows, pieces)](
        x, *filt, info, base, scratch, vocab, x.stride(0), piece,
        CAP=CAP, PIECES=P, STEPS=steps(BLOCK, piece), INTERPRET=interp, num_warps=8,
    )  # fmt: skip
    _finish_kernel[(rows,)](
        x, *filt, pmax, info, scratch, th, vocab, x.stride(0), pieces,
        CAP=CAP, PIECES=P, STEPS=steps(TALLY_BLOCK, vocab), INTERPRET=interp, num_warps=4,
    )  # fmt: skip
    return th
