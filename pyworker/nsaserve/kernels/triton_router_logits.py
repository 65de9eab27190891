"""Triton MoE router logits: float32 [T, E] = x [T, H] . W^T from W's three bf16 parts, one launch.

The same parts and the same accuracy argument as router_logits' "bf16x3" (read its notes): x is
bf16, so every product of x with a part is exact, and the error is in how the products are summed.
There, torch runs two GEMMs (the high part as a batch of 384-input chains, then mid and low), a
reduction over the chains and two adds: five launches and ~22 us a MoE layer at 256 tokens on the
H200, where the bytes (x and the three parts) take ~3 us. Here one kernel does it all:

- each program takes BLOCK_E experts x BLOCK_T tokens and a range of K blocks (a split of H, so
  that even one token fills the GPU: the parts are read once, by many programs at once);
- per K block of BLOCK_K inputs, the high part's MMA starts from zero and its float32 result is
  added to the running sum with a correctly rounded add (inline PTX: Triton would otherwise fold
  `acc + dot(a, b)` into the MMA's own accumulation, the long truncating chain the chunks avoid).
  So the high part's chains are BLOCK_K inputs long, shorter than "bf16x3"'s 384;
- the mid and low parts, 2^8 and 2^16 times smaller, accumulate in the MMA as one chain;
- with more than one split, each program stores its float32 partial sums, and the last program of
  a tile to finish (an atomic count) adds the splits in their fixed order: deterministic, whatever
  order the programs ran in. Its counts are zeroed per call, in the launch's stream (graph-safe).

Kind "router_logits", name "triton": (x [T, H] bf16, weight float32 [E, H], split bf16 [3E, H]) ->
float32 [T, E]; other dtypes take the float32 GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .triton_common import mma_operand

BLOCK_E = 64  # experts per program: the MMA's M side
BLOCK_K = 64  # inputs per high-part chain
# Tokens per program (the MMA's N side): 32 up to SMALL_BATCH tokens, else 64 (fewer re-reads of
# the parts); never more than the batch's power of two, nor fewer than 16.
SMALL_BATCH, BLOCK_T_SMALL, BLOCK_T_LARGE = 128, 32, 64
PROGRAMS_WANTED = 2  # programs per multiprocessor the split aims for
MAX_SPLIT = 16  # most ranges H is split into: the last program's sum loads them all at once
NUM_WARPS = 4


@triton.jit
def _add_rn(a, b, INTERPRET: tl.constexpr):
    """a + b rounded on its own (never merged into an MMA's accumulation)."""
    if INTERPRET:
        return a + b
    return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1)


# The token count and the split vary from step to step: run-time values, so that they never pick a
# new compiled variant (Triton specialises integers on == 1 and on divisibility by 16).
@triton.jit(do_not_specialize=["T", "SPLIT"])
def _router_logits_kernel(
    x_ptr, w_ptr, part_ptr, count_ptr, out_ptr, T, E, stride_x, SPLIT,
    H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    MAX_SPLIT: tl.constexpr, INTERPRET: tl.constexpr, I_STEPS: tl.constexpr = 0,
):  # fmt: skip
    """I_STEPS: the K loop's count as a constant, for Triton's CPU interpreter only (its loops cannot
    take bounds computed from program ids)."""
    pid_e, pid_t, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    e_ok, t_ok = offs_e < E, offs_t < T
    n_blocks: tl.constexpr = H // BLOCK_K
    k_first = pid_k * n_blocks // SPLIT
    k_end = (pid_k + 1) * n_blocks // SPLIT
    w_rows = w_ptr + offs_e.to(tl.int64)[:, None] * H
    x_cols = x_ptr + offs_t.to(tl.int64)[None, :] * stride_x
    acc_hi = tl.zeros([BLOCK_E, BLOCK_T], dtype=tl.float32)
    acc_small = tl.zeros([BLOCK_E, BLOCK_T], dtype=tl.float32)
    part_stride = E * H  # rows [E, 2E) of split are the mid parts, [2E, 3E) the low ones
    # A split holds floor or ceil(n_blocks / SPLIT) blocks: every program takes the ceiling's count
    # of steps, the last one masked off where its split is short.
    for j in range(I_STEPS if INTERPRET else tl.cdiv(n_blocks, SPLIT)):
        kb = k_first + j
        live = kb < k_end
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        x_ok = t_ok[None, :] & live
        xt = mma_operand(tl.load(x_cols + offs_k[:, None], mask=x_ok, other=0.0), INTERPRET)  # [K, T]
        w = w_rows + offs_k[None, :]
        w_ok = e_ok[:, None] & live
        hi = mma_operand(tl.load(w, mask=w_ok, other=0.0), INTERPRET)
        mid = mma_operand(tl.load(w + part_stride, mask=w_ok, other=0.0), INTERPRET)
        lo = mma_operand(tl.load(w + 2 * part_stride, mask=w_ok, other=0.0), INTERPRET)
        acc_hi = _add_rn(acc_hi, tl.dot(hi, xt), INTERPRET)
        acc_small = tl.dot(lo, xt, tl.dot(mid, xt, acc_small))
    # hi + (mid + lo), as "bf16x3" adds them: the small parts together first.
    res = acc_hi + acc_small
    out = offs_t.to(tl.int64)[None, :] * E + offs_e[:, None]
    ok = e_ok[:, None] & t_ok[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + out, res, mask=ok)
    else:
        split_stride = T * E
        tl.store(part_ptr + pid_k * split_stride + out, res, mask=ok)
        tl.debug_barrier()  # every thread's partial sums before the count that publishes them
        done = tl.atomic_add(count_ptr + pid_t * tl.num_programs(0) + pid_e, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:
            tl.debug_barrier()
            # Unrolled to MAX_SPLIT, so that every split's loads are in flight at once (a loop to
            # SPLIT would wait for each in turn); the splits past SPLIT add zeros.
            total = tl.zeros([BLOCK_E, BLOCK_T], dtype=tl.float32)
            for s in tl.static_range(MAX_SPLIT):
                at = part_ptr + s * split_stride + out
                total += tl.load(at, mask=ok & (s < SPLIT), other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + out, total, mask=ok)


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_shape(tokens: int, experts: int, hidden: int, multiprocessors: int) -> tuple[int, int]:
    """(BLOCK_T, SPLIT): H is split into as many ranges as it takes for PROGRAMS_WANTED programs a
    multiprocessor, rounded down to a divisor of its K-block count (uneven ranges cost a masked
    step and were slower: 36 against 26.5 us for 5 against 4 ranges at 1024 tokens on the H200)
    and at most MAX_SPLIT. Measured there at 256 experts x 6144 (bench/results/2026-12-04-router-logits-triton.md)."""
    block_t = min(BLOCK_T_SMALL if tokens <= SMALL_BATCH else BLOCK_T_LARGE, max(16, triton.next_power_of_2(tokens)))
    tiles = triton.cdiv(experts, BLOCK_E) * triton.cdiv(tokens, block_t)
    n_blocks = hidden // BLOCK_K
    wanted = min(n_blocks, MAX_SPLIT, triton.cdiv(PROGRAMS_WANTED * multiprocessors, tiles))
    split = max(d for d in range(1, wanted + 1) if n_blocks % d == 0)
    return block_t, split


def router_logits_triton(x: torch.Tensor, weight: torch.Tensor, split: torch.Tensor | None = None) -> torch.Tensor:
    """The registry's ("router_logits", "triton") backend (module notes)."""
    if split is None:
        raise ValueError("the Triton router logits need the weight's bf16 parts (split_bf16x3)")
    tokens, hidden = x.shape
    experts = weight.shape[0]
    if split.shape != (3 * experts, hidden) or split.dtype != torch.bfloat16:
        raise ValueError(f"split must be bf16 [{3 * experts}, {hidden}], got {split.dtype} {tuple(split.shape)}")
    if x.dtype != torch.bfloat16 or hidden % BLOCK_K:  # fp16 activations: the parts are bf16
        return F.linear(x.float(), weight)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(tokens, experts, dtype=torch.float32, device=x.device)
    if tokens == 0:
        return out
    block_t, n_split = launch_shape(tokens, experts, hidden, _multiprocessors(x.device))
    grid = (triton.cdiv(experts, BLOCK_E), triton.cdiv(tokens, block_t), n_split)
    interpret = x.device.type != "cuda"
    if n_split > 1:
        part = torch.empty(n_split, tokens, experts, dtype=torch.float32, device=x.device)
        count = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=x.device)
    else:
        part, count = out, out
    _router_logits_kernel[grid](
        x, split.contiguous(), part, count, out, tokens, experts, x.stride(0), n_split,
        H=hidden, BLOCK_E=BLOCK_E, BLOCK_T=block_t, BLOCK_K=BLOCK_K,
        MAX_SPLIT=MAX_SPLIT, INTERPRET=interpret, I_STEPS=triton.cdiv(hidden // BLOCK_K, n_split) if interpret else 0,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
