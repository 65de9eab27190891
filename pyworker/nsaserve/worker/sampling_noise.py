"""Random noise for the sampler.

Sampling is an exponential race (Gumbel-max): with E_i ~ Exp(1) independent, the token
argmax_i p_i / E_i is distributed as p. In log space that is argmax_i (logit_i + G_i) with
G_i = -log(E_i) = -log(-log U_i), U_i uniform. Only the uniforms are random, so a row's token is
a pure function of its filtered logits and its uniform row; that is what makes seeded requests
reproducible and what lets the reference sampler be compared token for token.

Seeded rows get their uniforms from a generator seeded with a mix of (request seed, position of
the token being sampled) and nothing else, so the batch they share does not matter. The stream
is torch's for that device: CPU and CUDA (and possibly different GPU models) give different
draws for one seed, so reproducibility holds on one kind of machine. Unseeded rows share one
draw from the caller's generator (torch's default one when none is given).
"""

from __future__ import annotations

import numpy as np
import torch

_M64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser over uint64 arrays (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def row_seeds(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Generator seed for each (request seed, token position): uint64 [n].

    Mixed so that neighbouring positions and neighbouring seeds give unrelated streams.
    """
    with np.errstate(over="ignore"):
        s = _splitmix64(np.asarray(seeds, dtype=np.uint64))
        return _splitmix64(s ^ np.asarray(positions, dtype=np.int64).astype(np.uint64))


def seeded_uniform(
    gen_seed: int, vocab: int, device: torch.device | str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The uniform row of one seeded request: a function of `gen_seed`, `vocab` and the device type."""
    g = torch.Generator(device=device)
    g.manual_seed(int(gen_seed) & _M64)
    if out is None:
        return torch.rand(vocab, generator=g, device=device)
    return torch.rand(vocab, generator=g, device=device, out=out)


def batch_uniform(
    num_rows: int,
    vocab: int,
    seeded: list[tuple[int, int]],
    device: torch.device | str,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Uniforms [S, V] in [0, 1): one shared draw, then the seeded rows overwritten with their own."""
    if len(seeded) == num_rows:
        u = torch.empty(num_rows, vocab, device=device)
    else:
        u = torch.rand(num_rows, vocab, generator=generator, device=device)
    # One small kernel per seeded row: unavoidable with per-row generators, and only seeded rows pay.
    for row, gen_seed in seeded:
        seeded_uniform(gen_seed, vocab, device, out=u[row])
    return u
