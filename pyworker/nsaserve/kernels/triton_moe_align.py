"""The align of the W4A16 MoE (triton_moe_w4a16.py): sorts the (token, k) slots by local expert
into blocks of BLOCK_M rows and permutes the activations for the gate/up kernel, with no host
synchronisation and every buffer sized by the worst case for the token count (max_blocks).

_moe_align_kernel, one program per local expert: counts the (token, k) slots per local expert,
pads each expert's run to a multiple of BLOCK_M, and writes its part of the sorted slot list
(-1 = padding) and the expert of each of its BLOCK_M blocks (-1 = unused block; those
programs exit at once). Paired (8-token blocks from 4 rows per expert, paired_blocks): runs of
more than BLOCK_M slots are padded to 2 BLOCK_M and their blocks marked in pairs, which the
expert kernels compute as blocks of 2 BLOCK_M. Slot order inside an expert is the input order, so the layout is
deterministic. One more program per token permutes the activations (_permute_row: input 8j + r of
each K block to position r·BLOCK_K/8 + j, the operand order of triton_moe_w4a16) in the same launch.
From ALIGN_CHUNKED_FROM slots (prompt-sized steps) three launches lay out the same thing in
chunks of slots instead (count per chunk, runs per expert, place per chunk), since every
expert's program scanning every slot grows as experts x slots.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _local_expert(ids_ptr, slots, n_slots, first_expert, num_local):
    """Local expert of each slot (int32), or -1 past the end or for an expert of another rank."""
    inb = slots < n_slots
    loc = (tl.load(ids_ptr + slots, mask=inb, other=-1) - first_expert).to(tl.int32)
    return tl.where(inb & (loc >= 0) & (loc < num_local), loc, -1)


@triton.jit
def _permute_row(x_ptr, xp_ptr, row, HIDDEN: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr):
    """xp[row] = x[row] in bf16 with input 8j + r of each BLOCK_K block at r * BLOCK_K / 8 + j."""
    for c in tl.static_range((HIDDEN + CHUNK - 1) // CHUNK):
        col = c * CHUNK + tl.arange(0, CHUNK)
        inb = col < HIDDEN
        v = tl.load(x_ptr + row * HIDDEN + col, mask=inb)
        within = col % BLOCK_K
        dst = col - within + (within % 8) * (BLOCK_K // 8) + within // 8
        tl.store(xp_ptr + row * HIDDEN + dst, v.to(tl.bfloat16), mask=inb)


@triton.jit
def _expert_run(
    block_expert_ptr, sorted_slot_ptr, counts, pid, max_blocks, expert_block_chunks, block_chunks,
    E_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, EXPERT_BLOCK_CHUNKS: tl.constexpr,
    BLOCK_CHUNKS: tl.constexpr, INTERPRET: tl.constexpr, PAIRED: tl.constexpr = False,
):  # fmt: skip
    """Local expert pid's run, from every local expert's slot count (counts [E_P2], 0 past
    num_local): marks its blocks, pads its run with -1 after its count slots, and (program 0)
    marks the blocks past the last run unused. -> (start of its run, its slot count).
    PAIRED (see _moe_gate_up_kernel): an expert with more than BLOCK_M slots gets a run padded to a
    multiple of 2 BLOCK_M, whose blocks are marked in pairs: -(e + 2) on the first block of each
    pair, -1 on the second; an expert with at most BLOCK_M slots keeps one block marked e."""
    offs_e = tl.arange(0, E_P2)
    offs_c = tl.arange(0, CHUNK)
    unit = BLOCK_M
    if PAIRED:
        unit = tl.where(counts > BLOCK_M, 2 * BLOCK_M, BLOCK_M)
    padded = (counts + unit - 1) // unit * unit
    start = tl.sum(tl.where(offs_e < pid, padded, 0), 0)
    count = tl.sum(tl.where(offs_e == pid, counts, 0), 0)
    my_blocks = tl.sum(tl.where(offs_e == pid, padded, 0), 0) // BLOCK_M
    mark = tl.full([CHUNK], 0, tl.int32) + pid
    if PAIRED:
        mark = tl.where(count > BLOCK_M, tl.where(offs_c % 2 == 0, -(pid + 2), -1), mark)
    for bc in range(EXPERT_BLOCK_CHUNKS if INTERPRET else expert_block_chunks):
        b = bc * CHUNK + offs_c
        tl.store(block_expert_ptr + start // BLOCK_M + b, mark, mask=b < my_blocks)
    if pid == 0:  # blocks past the last expert's run: their programs exit at once
        total_blocks = tl.sum(padded, 0) // BLOCK_M
        for bc in range(BLOCK_CHUNKS if INTERPRET else block_chunks):
            b = bc * CHUNK + offs_c
            tl.store(block_expert_ptr + b, tl.full([CHUNK], -1, tl.int32), mask=(b >= total_blocks) & (b < max_blocks))
    PAD: tl.constexpr = 2 * BLOCK_M if PAIRED else BLOCK_M
    pad = count + tl.arange(0, PAD)
    tl.store(sorted_slot_ptr + start + pad, tl.full([PAD], -1, tl.int32), mask=pad < my_blocks * BLOCK_M)
    return start, count


# Slot and block counts follow the token count: runtime values, not specialised, so a step of a
# new size compiles nothing (as constants they made a variant per power of two of the count).
@triton.jit(do_not_specialize=["n_slots", "max_blocks", "slot_chunks", "expert_block_chunks", "block_chunks"])
def _moe_align_kernel(
    ids_ptr, sorted_slot_ptr, block_expert_ptr, x_ptr, xp_ptr,
    n_slots, first_expert, num_local, max_blocks, slot_chunks, expert_block_chunks, block_chunks,
    E_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SLOT_CHUNKS: tl.constexpr,
    EXPERT_BLOCK_CHUNKS: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr, PAIRED: tl.constexpr = False,
):  # fmt: skip
    """Program e < num_local lays out local expert e's run; program num_local + t permutes token
    t's activations for the gate/up kernel (one launch for both). No program waits for another:
    each expert's program counts every expert to find where its run starts, and scans every slot
    for its own, O(experts x slots) in all: cheap at decode sizes, where one launch matters more;
    prompt-sized steps take the chunked kernels below. Loop counts: slot_chunks,
    expert_block_chunks, block_chunks (the tails are masked); the constants of the same names
    carry them for Triton's CPU interpreter (0 when compiled), which takes no runtime loop bound."""
    pid = tl.program_id(0)
    if pid >= num_local:
        _permute_row(x_ptr, xp_ptr, (pid - num_local).to(tl.int64), HIDDEN, BLOCK_K, 1024)
        return
    offs_e = tl.arange(0, E_P2)
    offs_c = tl.arange(0, CHUNK)
    # Slots per local expert; the last bin (E_P2 > num_local) collects slots of other ranks.
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for sc in range(SLOT_CHUNKS if INTERPRET else slot_chunks):
        loc = _local_expert(ids_ptr, sc * CHUNK + offs_c, n_slots, first_expert, num_local)
        counts += tl.histogram(tl.where(loc >= 0, loc, E_P2 - 1), E_P2)
    counts = tl.where(offs_e < num_local, counts, 0)
    start, count = _expert_run(
        block_expert_ptr, sorted_slot_ptr, counts, pid, max_blocks, expert_block_chunks, block_chunks,
        E_P2, BLOCK_M, CHUNK, EXPERT_BLOCK_CHUNKS, BLOCK_CHUNKS, INTERPRET, PAIRED,
    )  # fmt: skip
    # This expert's slots in input order (the -1 padding after them is _expert_run's).
    seen = 0
    for sc in range(SLOT_CHUNKS if INTERPRET else slot_chunks):
        s0 = sc * CHUNK
        mine = _local_expert(ids_ptr, s0 + offs_c, n_slots, first_expert, num_local) == pid
        rank = seen + tl.cumsum(mine.to(tl.int32), 0) - 1
        tl.store(sorted_slot_ptr + start + rank, s0 + offs_c, mask=mine)
        seen += tl.sum(mine.to(tl.int32), 0)


# The chunked align: the same sorted slots and blocks as _moe_align_kernel (slots in input order
# within each expert) in O(slots + experts x chunks) work, three launches. A chunk is SLOT_CHUNK
# consecutive slots; the tables hold one row of E_P2 per chunk.
@triton.jit(do_not_specialize=["n_slots", "n_chunks"])
def _moe_align_count_kernel(
    ids_ptr, chunk_count_ptr, chunk_before_ptr, total_ptr, x_ptr, xp_ptr, n_slots, first_expert, num_local, n_chunks,
    E_P2: tl.constexpr, SLOT_CHUNK: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program c < n_chunks: chunk c's slots per local expert (chunk_count[c]), how many of them go
    to lower-numbered experts (chunk_before[c]), and adds its counts to total (zeroed by the
    caller; integer sums, so the order of the additions does not matter). Program n_chunks + t
    permutes token t's activations."""
    pid = tl.program_id(0)
    if pid >= n_chunks:
        _permute_row(x_ptr, xp_ptr, (pid - n_chunks).to(tl.int64), HIDDEN, BLOCK_K, 1024)
        return
    offs_e = tl.arange(0, E_P2)
    loc = _local_expert(ids_ptr, pid * SLOT_CHUNK + tl.arange(0, SLOT_CHUNK), n_slots, first_expert, num_local)
    counts = tl.histogram(tl.where(loc >= 0, loc, E_P2 - 1), E_P2)
    counts = tl.where(offs_e < num_local, counts, 0)
    row = pid.to(tl.int64) * E_P2 + offs_e
    tl.store(chunk_count_ptr + row, counts)
    tl.store(chunk_before_ptr + row, tl.cumsum(counts, 0) - counts)
    tl.atomic_add(total_ptr + offs_e, counts, mask=offs_e < num_local)


# n_chunks too: as a specialised integer (divisible by 16 or not) it compiled a variant in the
# middle of serving for a prompt step whose chunk count the warm-up's powers of two never had.
@triton.jit(do_not_specialize=["n_chunks", "max_blocks", "expert_block_chunks", "block_chunks", "chunk_blocks"])
def _moe_align_runs_kernel(
    total_ptr, chunk_count_ptr, chunk_before_ptr, chunk_base_ptr, sorted_slot_ptr, block_expert_ptr,
    n_chunks, max_blocks, expert_block_chunks, block_chunks, chunk_blocks,
    E_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, EXPERT_BLOCK_CHUNKS: tl.constexpr,
    BLOCK_CHUNKS: tl.constexpr, CHUNK_BLOCKS: tl.constexpr, INTERPRET: tl.constexpr, PAIRED: tl.constexpr = False,
):  # fmt: skip
    """Program e (one per local expert) lays out expert e's run and, for each chunk c, where the
    chunk's first slot of expert e lands, less the chunk's slots of lower experts (chunk_base[c, e]:
    the place kernel adds the slot's position in its chunk sorted by expert)."""
    pid = tl.program_id(0)
    offs_e = tl.arange(0, E_P2)
    counts = tl.load(total_ptr + offs_e)  # 0 past num_local
    start, _ = _expert_run(
        block_expert_ptr, sorted_slot_ptr, counts, pid, max_blocks, expert_block_chunks, block_chunks,
        E_P2, BLOCK_M, CHUNK, EXPERT_BLOCK_CHUNKS, BLOCK_CHUNKS, INTERPRET, PAIRED,
    )  # fmt: skip
    offs_c = tl.arange(0, CHUNK)
    seen = start
    for cb in range(CHUNK_BLOCKS if INTERPRET else chunk_blocks):
        c = cb * CHUNK + offs_c
        at = c.to(tl.int64) * E_P2 + pid
        inb = c < n_chunks
        mine = tl.load(chunk_count_ptr + at, mask=inb, other=0)
        before = tl.load(chunk_before_ptr + at, mask=inb, other=0)
        tl.store(chunk_base_ptr + at, seen + tl.cumsum(mine, 0) - mine - before, mask=inb)
        seen += tl.sum(mine, 0)


@triton.jit(do_not_specialize=["n_slots"])
def _moe_align_place_kernel(
    ids_ptr, chunk_base_ptr, sorted_slot_ptr, n_slots, first_expert, num_local,
    E_P2: tl.constexpr, SLOT_CHUNK: tl.constexpr,
):  # fmt: skip
    """Program c: chunk c's slots sorted by (expert, slot) (an in-register sort of unique keys);
    the slot at sorted position j of expert e goes to chunk_base[c, e] + j."""
    pid = tl.program_id(0)
    offs = tl.arange(0, SLOT_CHUNK)
    loc = _local_expert(ids_ptr, pid * SLOT_CHUNK + offs, n_slots, first_expert, num_local)
    key = tl.sort(tl.where(loc >= 0, loc, E_P2 - 1) * SLOT_CHUNK + offs)
    expert = key // SLOT_CHUNK
    base = tl.load(chunk_base_ptr + pid.to(tl.int64) * E_P2 + expert, mask=expert < num_local, other=0)
    tl.store(sorted_slot_ptr + base + offs, pid * SLOT_CHUNK + key % SLOT_CHUNK, mask=expert < num_local)


# From this many (token, k) slots the chunked align (three launches, O(slots + experts x chunks))
# replaces the one-launch align that scans every slot once per expert (O(experts x slots); the
# step profile put it at 7.9 ms of a 16 x 1000-token prefill step with 6 MoE layers). Measured on
# the H200 at 256 experts, top-8 (bench/results/2026-12-01-triton-moe-tiled), one launch against
# chunked: 256 tokens 24.1 / 22.0 us, 512 41.8 / 23.1, 2048 157 / 38.2, 16384 1282 / 161. Fewer
# slots are not timed, so they keep the one launch.
ALIGN_CHUNKED_FROM = 2048
ALIGN_SLOT_CHUNK = 1024  # slots per chunk of the chunked align (sorted in registers)


def _align(x, ids, first_expert, num_local, block_m, nblocks, block_k, chunked: bool | None = None, paired=False):
    """Sort the (token, k) slots by local expert into BLOCK_M blocks and permute the activations
    for the gate/up kernel -> (sorted_slot [nblocks * block_m], block_expert [nblocks], xp).
    paired: experts with more than block_m slots in pairs of blocks (_expert_run's PAIRED)."""
    num_tokens, hidden = x.shape
    n_slots = ids.numel()
    dev = x.device
    sorted_slot = torch.empty(nblocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nblocks, dtype=torch.int32, device=dev)
    xp = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=dev)
    e_p2 = triton.next_power_of_2(num_local + 1)  # the last bin collects other ranks' slots
    chunk = 256
    interpret = _INTERPRET or not x.is_cuda
    run_blocks = triton.cdiv(n_slots, block_m) + (1 if paired else 0)  # the most blocks one expert's run takes
    loops = (triton.cdiv(n_slots, chunk), triton.cdiv(run_blocks, chunk), triton.cdiv(nblocks, chunk))
    const = loops if interpret else (0, 0, 0)
    x = x.contiguous()
    if chunked is None:
        chunked = n_slots >= ALIGN_CHUNKED_FROM
    if not chunked:
        _moe_align_kernel[(num_local + num_tokens,)](
            ids, sorted_slot, block_expert, x, xp, n_slots, first_expert, num_local, nblocks, *loops,
            E_P2=e_p2, BLOCK_M=block_m, CHUNK=chunk, SLOT_CHUNKS=const[0], EXPERT_BLOCK_CHUNKS=const[1],
            BLOCK_CHUNKS=const[2], HIDDEN=hidden, BLOCK_K=block_k, INTERPRET=interpret, PAIRED=paired, num_warps=4,
        )  # fmt: skip
        return sorted_slot, block_expert, xp
    n_chunks = triton.cdiv(n_slots, ALIGN_SLOT_CHUNK)
    chunk_count = torch.empty(n_chunks, e_p2, dtype=torch.int32, device=dev)
    chunk_before = torch.empty_like(chunk_count)
    chunk_base = torch.empty_like(chunk_count)
    total = torch.zeros(e_p2, dtype=torch.int32, device=dev)
    _moe_align_count_kernel[(n_chunks + num_tokens,)](
        ids, chunk_count, chunk_before, total, x, xp, n_slots, first_expert, num_local, n_chunks,
        E_P2=e_p2, SLOT_CHUNK=ALIGN_SLOT_CHUNK, HIDDEN=hidden, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    chunk_blocks = triton.cdiv(n_chunks, chunk)
    _moe_align_runs_kernel[(num_local,)](
        total, chunk_count, chunk_before, chunk_base, sorted_slot, block_expert,
        n_chunks, nblocks, loops[1], loops[2], chunk_blocks,
        E_P2=e_p2, BLOCK_M=block_m, CHUNK=chunk, EXPERT_BLOCK_CHUNKS=const[1], BLOCK_CHUNKS=const[2],
        CHUNK_BLOCKS=chunk_blocks if interpret else 0, INTERPRET=interpret, PAIRED=paired, num_warps=4,
    )  # fmt: skip
    _moe_align_place_kernel[(n_chunks,)](
        ids, chunk_base, sorted_slot, n_slots, first_expert, num_local,
        E_P2=e_p2, SLOT_CHUNK=ALIGN_SLOT_CHUNK, num_warps=4,
    )  # fmt: skip
    return sorted_slot, block_expert, xp
