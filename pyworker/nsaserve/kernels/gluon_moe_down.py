"""The NVFP4 MoE's down projection in Gluon (Triton's explicit-layout dialect), Hopper only: one
persistent program per multiprocessor slot that streams the weights of tile after tile through
one cp.async pipeline.

Same function and the same bits as triton_moe_w4a16._moe_down_kernel on the tiled layout
(tile_nvfp4 after relayout_nvfp4): y[slot] = (a_2 · W2 · h[row]^T)^T · routing weight, bf16, for
every real (token, k) row of every used expert block; the same dequantised operand values, and the
same MMAs in the same K order, so the float32 sums round identically.

What it tries: the Triton kernel is one program per 128-row output tile, 8 K blocks of 256 inputs
at GLM-5's intermediate size, each program starting with an empty pipeline; it reads its weights
at ~3.1-3.2 TB/s where the gate/up kernel (24 K blocks a tile) reaches ~3.5, and Triton cannot carry
a pipeline from one tile into the next without serialising its asynchronous MMAs
(bench/results/2026-12-04-triton-moe-tiles.md). Here:
- a program takes tiles pid, pid + G, ... (G programs: a fixed grid, so CUDA graphs replay it for
  any routing) and its loop runs over (tile, K block) pairs: the copies for STAGES - 1 K blocks ahead
  are always in flight, across tile boundaries;
- a tile's first MMA does not read the accumulator (use_acc=False), so no zeroing sits between the
  tiles' MMAs;
- each K block is dequantised and multiplied a quarter (64 inputs) at a time, so the bf16 operand in
  registers is 32 values a thread, not 128 (168 registers where the Triton kernel takes 212).

What it measured (bench/results/2026-12-04-gluon-moe-down.md): the same bits, and the whole routed
path within -2% to +1% of the Triton kernel's time at 64 and 256 tokens (slower at 1 token and at
32-token blocks), so it is an option (the MoE config's down GLUON), not the default. ncu puts both
down kernels at ~0.6 instructions issued per scheduler per cycle with the L2 at ~80% and the DRAM at
~67-70% of peak: starting programs with empty pipelines was not what held the Triton kernel back.
A warp-specialised version built on it (a TMA loader warp feeding the consumer warpgroup) was
slower still: the routed path runs at the board's 700 W power cap, so better overlap only lowers
the clock (bench/results/2026-12-04-moe-power-cap.md). It stays as the base for tries that cut
the energy per weight instead.

Operand order: the gate/up kernel stores h in the K-block permutation of the Triton kernels (input
8j + r of a K block at position r · 32 + j). K position q · 32 + 2j + h of a block is then input
16j + q + 8h, which is half h of pair q % 4 of word 2j (q < 4) or 2j + 1 (q >= 4) of the row's
block: the dequantisation's bf16x2 registers are exactly the MMA's A-operand registers (a thread
holds K positions 2c, 2c + 1, 2c + 8, 2c + 9 of each 16, c = lane % 4), so each thread loads the
words j = c, c + 4, c + 8, c + 12 of its rows and no value moves between threads.

Gluon has no CPU interpreter: the Triton kernel takes every call this one does not (CPU, other
GPUs, other layouts); the GPU tests compare the two bit for bit.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .quant.nvfp4 import TILE_K as _TILE_K
from .quant.nvfp4 import TILE_ROWS as _TILE_ROWS
from .triton_moe_dequant import word_pairs_asm

NUM_WARPS = gl.constexpr(4)  # one warpgroup
BLOCK_N = gl.constexpr(128)  # output (hidden) rows per tile: the MMA's M, two 64-row halves
TILE_ROWS = gl.constexpr(_TILE_ROWS)  # rows of a tile of the tiled layout
BLOCK_K = gl.constexpr(_TILE_K)  # inputs per pipeline stage: one tile of the tiled layout
SUB_K = gl.constexpr(64)  # inputs dequantised and multiplied at a time
# Pipeline depth, programs per multiprocessor and the register cap that lets three fit (168 a
# thread: ptxas needs 184 uncapped, no spills at 168). A stage is 16 KB of codes, 2 KB of scales and
# BM x 512 bytes of h: two stages of 16-token blocks take 53 KB. Measured on the H200 at GLM-5 shapes
# (bench/results/2026-12-04-gluon-moe-down.md), whole routed path against the Triton down kernel in
# the same runs: 2 stages x 3 programs 1469-1474 against 1491-1497 us at 64 tokens, 1791-1801 against
# 1794-1820 at 256; 4 stages x 2 programs 1471-1521 / 1802-1822; deeper or fewer programs slower.
STAGES = 2
PROGRAMS_PER_SM = 3
MAXNREG = 168

# Pairs (0, 1) and (2, 3) of one word: K positions 0-63 (q = 0, 1) and 64-127 (q = 2, 3) of the
# block from its even words; 128-191 and 192-255 from its odd words.
_ASM_PAIRS01 = gl.constexpr(word_pairs_asm(0, 1))
_ASM_PAIRS23 = gl.constexpr(word_pairs_asm(2, 3))


@gluon.constexpr_function
def _words_layout():
    """A K block's code words [BLOCK_N rows, 32] as the dequantisation reads them: thread (warp w,
    lane l) holds rows 16w + l // 4 (+ 8, + 64, + 72), words 2c + {0, 1} + {0, 8, 16, 24} (c = l % 4):
    the rows of its MMA A-operand registers and the words of its K positions."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 8], [0, 16], [8, 0], [64, 0]],
        lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[128, 32],
    )


@gluon.constexpr_function
def _groups_layout():
    """[BLOCK_N rows, 16 groups]: the even (or odd) words of _words_layout, one per 16-input group
    j, and the groups' scales: thread c holds groups c, c + 4, c + 8, c + 12 of its rows."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 4], [0, 8], [8, 0], [64, 0]],
        lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[128, 16],
    )


@gluon.jit
def _operand(words, scale, ASM: gl.constexpr, a_l: gl.constexpr):
    """The bf16 A operand [BLOCK_N, SUB_K] of two pairs of the words [BLOCK_N, 16] (one per group
    j): K position e · 32 + 2j + h holds half h of pair e of group j's word."""
    ty: gl.constexpr = (gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16)
    lo0, hi0, lo1, hi1 = gl.inline_asm_elementwise(
        ASM, "=h,=h,=h,=h,r,r", [words, scale], dtype=ty, is_pure=True, pack=1
    )
    t0 = gl.reshape(gl.join(lo0, hi0), [BLOCK_N, 32])
    t1 = gl.reshape(gl.join(lo1, hi1), [BLOCK_N, 32])
    a = gl.reshape(gl.permute(gl.join(t0, t1), [0, 2, 1]), [BLOCK_N, SUB_K])
    return gl.convert_layout(a, a_l, assert_trivial=True)


@gluon.jit
def _stage_words(w_stage, s_stage, words_l: gl.constexpr, groups_l: gl.constexpr):
    """(even words, odd words, bf16x2 scales) [BLOCK_N, 16] of a stage's K block."""
    w = w_stage.load(words_l)
    even, odd = gl.split(gl.reshape(w, [BLOCK_N, 16, 2]))
    even = gl.convert_layout(even, groups_l, assert_trivial=True)
    odd = gl.convert_layout(odd, groups_l, assert_trivial=True)
    # bf16x2 bits of (scale · 2^119, scale · 2^119) from each re-encoded scale byte.
    scale = s_stage.load(groups_l).to(gl.int32) * 0x100010 + 0x76007600
    return even, odd, scale


@gluon.jit
def _rest_of_block(even, odd, scale, hk, acc, a_prev, a_l: gl.constexpr):
    """K positions 64-255 of a K block (its first quarter's MMA issued): three operands and MMAs, each
    issue followed by the retirement of the one before -> (acc, the last operand, still in use)."""
    a = _operand(even, scale, _ASM_PAIRS23, a_l)
    acc = warpgroup_mma(a, hk.slice(SUB_K, SUB_K, dim=1).permute((1, 0)), acc, is_async=True)
    acc, a_prev = warpgroup_mma_wait(1, deps=(acc, a_prev))
    a_prev = a
    a = _operand(odd, scale, _ASM_PAIRS01, a_l)
    acc = warpgroup_mma(a, hk.slice(2 * SUB_K, SUB_K, dim=1).permute((1, 0)), acc, is_async=True)
    acc, a_prev = warpgroup_mma_wait(1, deps=(acc, a_prev))
    a_prev = a
    a = _operand(odd, scale, _ASM_PAIRS23, a_l)
    acc = warpgroup_mma(a, hk.slice(3 * SUB_K, SUB_K, dim=1).permute((1, 0)), acc, is_async=True)
    acc, a_prev = warpgroup_mma_wait(1, deps=(acc, a_prev))
    return acc, a


@gluon.jit
def _copy_tiled(smem, ptr, group0, kb, TPR: gl.constexpr, WIDTH: gl.constexpr, layout: gl.constexpr, live):
    """cp.async K block kb of the BLOCK_N rows from row group group0 on of a tiled stack (WIDTH
    elements of a row per tile, TPR tiles along a row) into smem [BLOCK_N, WIDTH]."""
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    at = ((group0 + rows // TILE_ROWS) * TPR + kb) * (TILE_ROWS * WIDTH) + (rows % TILE_ROWS) * WIDTH
    # (rows < BLOCK_N: always true; it gives the scalar `live` the copy's 2-D shape.)
    async_copy.async_copy_global_to_shared(
        smem, ptr + at[:, None] + cols[None, :], mask=live & (rows < BLOCK_N)[:, None]
    )


@gluon.jit
def _issue_loads(w_smem, s_smem, h_smem, w_ptr, s_ptr, h_ptr, block_expert_ptr, nblocks, j, total, pid, G,
                 HIDDEN: gl.constexpr, INTER: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """cp.async the codes, scales and h columns of step j (K block j % KB of this program's tile
    j // KB) into stage j % STAGES, and commit them as one group (an empty one past the last step)."""
    KB: gl.constexpr = INTER // BLOCK_K
    NT: gl.constexpr = HIDDEN // BLOCK_N
    TPR: gl.constexpr = INTER // BLOCK_K  # tiles along a row of the tiled layout
    live = j < total
    tile = pid + (j // KB) * G
    kb = j % KB
    pid_m = tile // NT
    pid_n = tile % NT
    e = gl.load(block_expert_ptr + pid_m, mask=live & (pid_m < nblocks), other=0)
    group0 = (e.to(gl.int64) * HIDDEN + pid_n * BLOCK_N) // TILE_ROWS  # the tile's first row group
    stage = j % STAGES

    # Codes: 16 bytes a copy; scales: a row's 16 bytes a copy.
    w_cl: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NUM_WARPS, 1], [1, 0])
    _copy_tiled(w_smem.index(stage), w_ptr, group0, kb, TPR, 32, w_cl, live)
    s_cl: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [NUM_WARPS, 1], [1, 0])
    _copy_tiled(s_smem.index(stage), s_ptr, group0, kb, TPR, 16, s_cl, live)
    h_cl: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])
    offs_m = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, h_cl))
    offs_k = kb * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, h_cl))
    async_copy.async_copy_global_to_shared(
        h_smem.index(stage), h_ptr + offs_m.to(gl.int64)[:, None] * INTER + offs_k[None, :],
        mask=live & (offs_m >= 0)[:, None],
    )  # fmt: skip
    async_copy.commit_group()


@gluon.jit(do_not_specialize=["nblocks"])
def _moe_down_gluon_kernel(
    h_ptr, w_ptr, s_ptr, s2_ptr, sorted_slot_ptr, block_expert_ptr, topk_w_ptr, y_ptr, nblocks,
    HIDDEN: gl.constexpr, INTER: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr, FIX: gl.constexpr,
):  # fmt: skip
    KB: gl.constexpr = INTER // BLOCK_K
    NT: gl.constexpr = HIDDEN // BLOCK_N
    pid = gl.program_id(0)
    G = gl.num_programs(0)

    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
    w_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
    s_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    h_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 32], w_sl)
    s_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 16], s_sl)
    h_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BLOCK_K], h_sl)

    # Used blocks come first (the align kernel marks the rest -1): count them.
    cnt_l: gl.constexpr = gl.BlockedLayout([2], [32], [NUM_WARPS], [0])
    used = gl.zeros([256], gl.int32, layout=cnt_l)
    for c in range(0, nblocks, 256):
        offs = c + gl.arange(0, 256, layout=cnt_l)
        used += (gl.load(block_expert_ptr + offs, mask=offs < nblocks, other=-1) >= 0).to(gl.int32)
    tiles = gl.sum(used, axis=0) * NT
    total = gl.maximum(tiles - pid + G - 1, 0) // G * KB  # this program's (tile, K block) steps

    for j in gl.static_range(STAGES - 1):
        _issue_loads(w_smem, s_smem, h_smem, w_ptr, s_ptr, h_ptr, block_expert_ptr, nblocks, j, total, pid, G,
                     HIDDEN, INTER, BM, STAGES)  # fmt: skip

    words_l: gl.constexpr = _words_layout()
    groups_l: gl.constexpr = _groups_layout()
    ep_m: gl.constexpr = gl.SliceLayout(0, mma_l)
    ep_n: gl.constexpr = gl.SliceLayout(1, mma_l)
    acc = gl.zeros([BLOCK_N, BM], gl.float32, layout=mma_l)
    a_prev = gl.zeros([BLOCK_N, SUB_K], gl.bfloat16, layout=a_l)
    for it in range(total):
        stage = it % STAGES
        kb = it % KB
        # Step it's copies have landed (every thread's: the barrier), visible to the MMA's async
        # proxy; every thread has also read step it - 1's codes and scales.
        async_copy.wait_group(STAGES - 2)
        fence_async_shared()
        gl.thread_barrier()
        hk = h_smem.index(stage)
        even, odd, scale = _stage_words(w_smem.index(stage), s_smem.index(stage), words_l, groups_l)
        a = _operand(even, scale, _ASM_PAIRS01, a_l)
        acc = warpgroup_mma(a, hk.slice(0, SUB_K, dim=1).permute((1, 0)), acc, use_acc=kb > 0, is_async=True)
        # Retires the previous step's last MMA: its operand registers and its stage are free.
        acc, a_prev = warpgroup_mma_wait(1, deps=(acc, a_prev))
        _issue_loads(w_smem, s_smem, h_smem, w_ptr, s_ptr, h_ptr, block_expert_ptr, nblocks, it + STAGES - 1, total,
                     pid, G, HIDDEN, INTER, BM, STAGES)  # fmt: skip
        acc, a_prev = _rest_of_block(even, odd, scale, hk, acc, a, a_l)
        if kb == KB - 1:
            acc, a_prev = warpgroup_mma_wait(0, deps=(acc, a_prev))
            tile = pid + (it // KB) * G
            pid_m = tile // NT
            pid_n = tile % NT
            e = gl.load(block_expert_ptr + pid_m)
            offs_m = pid_m * BM + gl.arange(0, BM, layout=ep_m)
            slot = gl.load(sorted_slot_ptr + offs_m)
            valid = slot >= 0
            route_w = gl.load(topk_w_ptr + slot, mask=valid, other=0.0)
            y = acc * (gl.load(s2_ptr + e) * FIX) * route_w[None, :]
            offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=ep_n)
            gl.store(
                y_ptr + slot.to(gl.int64)[None, :] * HIDDEN + offs_n[:, None], y.to(gl.bfloat16), mask=valid[None, :]
            )
    async_copy.wait_group(0)


def takes(hidden: int, inter: int, block_m: int, device: torch.device) -> bool:
    """Whether this kernel takes a down projection: a Hopper GPU, whole 128-row tiles of the
    hidden size, K blocks of the tiled layout, 16- or 32-token blocks."""
    return (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] == 9
        and hidden % BLOCK_N.value == 0
        and inter % BLOCK_K.value == 0
        and block_m in (16, 32)
    )


def moe_down_gluon(
    h: torch.Tensor,  # bf16 [blocks * BM, I], rows in sorted order, each K block permuted
    w2_words: torch.Tensor,  # int32 [E, H, I/8], tiled (tile_nvfp4 after relayout_nvfp4)
    w2_scale: torch.Tensor,  # uint8 [E, H, I/16], tiled re-encoded scales
    w2_scale_2: torch.Tensor,  # float32 [E, 1]
    sorted_slot: torch.Tensor,  # int32 [blocks * BM]: (token, k) slot of each sorted row, -1 padding
    block_expert: torch.Tensor,  # int32 [blocks]: local expert of each block, -1 unused (a suffix)
    routing_w: torch.Tensor,  # float32 [T * k]
    y: torch.Tensor,  # bf16 [T * k, H], written for the slots of used blocks
    block_m: int,
    fix: float,
    stages: int | None = None,
    programs_per_sm: int | None = None,
    maxnreg: int | None = MAXNREG,
) -> None:
    """The down projection of moe_experts_nvfp4_triton (tiled layout, inline-assembly path) into y.
    Device-only: no host synchronisation, a grid fixed by the device (CUDA-graph capturable)."""
    _, hidden, kw = w2_words.shape
    inter = kw * 8
    programs = torch.cuda.get_device_properties(h.device).multi_processor_count * (programs_per_sm or PROGRAMS_PER_SM)
    _moe_down_gluon_kernel[(programs,)](
        h, w2_words, w2_scale, w2_scale_2, sorted_slot, block_expert, routing_w, y, block_expert.numel(),
        HIDDEN=hidden, INTER=inter, BM=block_m, STAGES=stages or STAGES, FIX=fix, num_warps=NUM_WARPS,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip
