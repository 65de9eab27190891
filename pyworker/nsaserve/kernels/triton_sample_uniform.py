"""Triton "sample_uniform" backend: every row's uniforms in one pass, from each row's seed.

The stream is defined in sample_uniform.py (Philox4x32-10 keyed by the row's seed); this computes
the same 32-bit words with uint32 arithmetic (hardware high/low multiplies) and the same exact
conversion, so its values equal the torch reference's bit for bit. A program takes BLOCK counters
of one row and stores their four words into the row's four quarters (contiguous stores each).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sample_uniform import M0, M1, ROUNDS, W0, W1, quarter

BLOCK = 1024  # counters per program: 4096 values


@triton.jit
def _sample_uniform_kernel(
    seeds_ptr, u_ptr, vocab, q, stride_u,
    M0: tl.constexpr, M1: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, ROUNDS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seeds_ptr + row)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    m0 = tl.full([BLOCK], M0, tl.uint32)
    m1 = tl.full([BLOCK], M1, tl.uint32)
    c0 = j.to(tl.uint32)
    c1 = tl.zeros([BLOCK], tl.uint32)
    c2 = tl.zeros([BLOCK], tl.uint32)
    c3 = tl.zeros([BLOCK], tl.uint32)
    for _ in tl.static_range(ROUNDS):
        n0 = tl.umulhi(m1, c2) ^ c1 ^ k0
        n2 = tl.umulhi(m0, c0) ^ c3 ^ k1
        c1 = m1 * c2
        c3 = m0 * c0
        c0 = n0
        c2 = n2
        k0 = k0 + W0
        k1 = k1 + W1
    base = u_ptr + row * stride_u
    scale = 1.0 / 16777216.0  # 2^-24
    tl.store(base + j, (c0 >> 8).to(tl.float32) * scale, mask=(j < q) & (j < vocab))
    tl.store(base + q + j, (c1 >> 8).to(tl.float32) * scale, mask=(j < q) & (q + j < vocab))
    tl.store(base + 2 * q + j, (c2 >> 8).to(tl.float32) * scale, mask=(j < q) & (2 * q + j < vocab))
    tl.store(base + 3 * q + j, (c3 >> 8).to(tl.float32) * scale, mask=(j < q) & (3 * q + j < vocab))


def sample_uniform_triton(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """The registry's ("sample_uniform", "triton") backend: same arguments as sample_uniform_torch."""
    rows = seeds.shape[0]
    u = torch.empty(rows, vocab, dtype=torch.float32, device=seeds.device)
    if rows == 0 or vocab == 0:
        return u
    q = quarter(vocab)
    _sample_uniform_kernel[(rows, triton.cdiv(q, BLOCK))](
        seeds.to(torch.int64).contiguous(), u, vocab, q, u.stride(0),
        M0=M0, M1=M1, W0=W0, W1=W1, ROUNDS=ROUNDS, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
    return u
