"""The sampler's noise: uniforms in [0, 1) per row, a pure function of the row's 64-bit seed.

Kind "sample_uniform": (seeds int64 [S] (any 64-bit pattern), vocab int) -> float32 [S, vocab].

The generator is Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC 2011): a counter-based generator, so any value can be computed on its own from (key,
counter), which is what lets one kernel fill every row at once whatever each row's seed. Why a
stream of our own rather than torch's generators: a seeded row used to need a generator object
and one launch of its own (13 us of host time a row; 6.8 ms a step at 512 seeded rows of 1024 on
an H200), and torch's CPU and CUDA streams differ, so a seed drew different tokens on each.

The stream, as every backend computes it (integers exact, so bit for bit everywhere):
- key = (low 32 bits of the seed, high 32 bits); counter = (j, 0, 0, 0) for j < Q = ceil(V / 4);
- ten rounds: (c0, c1, c2, c3) <- (hi(M1 * c2) ^ c1 ^ k0, lo(M1 * c2), hi(M0 * c0) ^ c3 ^ k1,
  lo(M0 * c0)) with M0 = 0xD2511F53, M1 = 0xCD9E8D57, then the key grows by (0x9E3779B9,
  0xBB67AE85) mod 2^32;
- output word i of counter j is column i * Q + j (the four words fill four quarters of the row);
- a word w becomes (w >> 8) * 2^-24: 24 random bits, exact in float32, never 1.0.

The torch reference below computes it with int64 tensors (about forty passes over [S, V]: fine for
tests and the CPU worker's small vocabularies); the "triton" backend (triton_sample_uniform.py)
writes each row in one pass.
"""

from __future__ import annotations

import torch

from .registry import register

M0, M1 = 0xD2511F53, 0xCD9E8D57  # the round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # the key schedule's increments (Weyl sequence)
ROUNDS = 10
MASK32 = 0xFFFFFFFF


def _mul_hi_lo(m: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32 bits of the 64-bit product m * c, c holding values below 2^32 in int64.

    The product can pass 2^63: int64 multiplication wraps modulo 2^64, which keeps all 64 bits
    of it (in two's complement), and the masks below take the two halves back out."""
    p = c * m
    return (p >> 32) & MASK32, p & MASK32


def philox_rounds(c: list[torch.Tensor], k: list[torch.Tensor]) -> list[torch.Tensor]:
    """Philox4x32-10 of counter words c[0..3] and key words k[0..1] (int64 tensors holding uint32
    values, broadcastable) -> the four output words."""
    c0, c1, c2, c3 = c
    k0, k1 = k
    for _ in range(ROUNDS):
        hi0, lo0 = _mul_hi_lo(M0, c0)
        hi1, lo1 = _mul_hi_lo(M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + W0) & MASK32, (k1 + W1) & MASK32
    return [c0, c1, c2, c3]


def philox4x32(seeds: torch.Tensor, counters: torch.Tensor) -> list[torch.Tensor]:
    """The four output words of counter (j, 0, 0, 0) under key = seed, for every seed in `seeds`
    [S] and j in `counters` [N] -> four [S, N] int64 tensors holding uint32 values."""
    s = seeds.to(torch.int64).unsqueeze(1)
    c0 = counters.to(torch.int64).unsqueeze(0).expand(s.shape[0], -1)
    zero = torch.zeros_like(c0)
    return philox_rounds([c0, zero, zero, zero], [s & MASK32, (s >> 32) & MASK32])


def quarter(vocab: int) -> int:
    """Q: counters per row (each gives four values, one per quarter of the row)."""
    return -(-vocab // 4)


@register("sample_uniform", "torch")
def sample_uniform_torch(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    q = quarter(vocab)
    words = philox4x32(seeds, torch.arange(q, device=seeds.device))
    u = torch.cat(words, dim=1)[:, :vocab]  # word i fills columns [i * Q, (i + 1) * Q)
    return (u >> 8).to(torch.float32) * 2.0**-24
