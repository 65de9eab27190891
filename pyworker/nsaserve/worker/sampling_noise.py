"""Random noise for the sampler.

Sampling is an exponential race (Gumbel-max): with E_i ~ Exp(1) independent, the token
argmax_i p_i / E_i is distributed as p. In log space that is argmax_i (logit_i + G_i) with
G_i = -log(E_i) = -log(-log U_i), U_i uniform. Only the uniforms are random, so a row's token is
a pure function of its filtered logits and its uniform row; that is what makes seeded requests
reproducible and what lets the reference sampler be compared token for token.

Every row's uniforms come from one counter-based stream keyed by a 64-bit seed (kernel kind
"sample_uniform": Philox4x32-10, defined in kernels/sample_uniform.py), all rows in one launch.
Seeded rows key it with a mix of (request seed, position of the token being sampled) and nothing
else, so the batch they share does not matter; the stream is integer arithmetic, so a seed draws
the same uniforms on the CPU and on any GPU. Unseeded rows key it with seeds drawn from the
caller's generator (torch's default one when none is given), one int64 per row.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.registry import get_backend, resolve
from .host_to_device import upload


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


def seeded_uniform(gen_seed: int, vocab: int, device: torch.device | str, backend: str = "auto") -> torch.Tensor:
    """The uniform row [vocab] of one seeded request: a function of `gen_seed` and `vocab` alone."""
    return batch_uniform(1, vocab, [(0, gen_seed)], device, backend=backend)[0]


def batch_uniform(
    num_rows: int,
    vocab: int,
    seeded: list[tuple[int, int]],
    device: torch.device | str,
    generator: torch.Generator | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Uniforms [S, V] in [0, 1): row i keyed by its own seed from `seeded` (row, generator seed),
    else by a seed drawn from `generator`."""
    device = torch.device(device)
    seeds = torch.empty(num_rows, dtype=torch.int64, device=device)
    if len(seeded) < num_rows:
        seeds.random_(generator=generator)  # 63 random bits a row (random_ draws in [0, 2^63))
    if seeded:
        # Through pinned memory (upload): a copy from pageable memory would wait for the forward
        # queued before it, and hold the host's next launch back with it.
        rows = np.array([r for r, _ in seeded], dtype=np.int64)
        bits = np.array([s for _, s in seeded], dtype=np.uint64).view(np.int64)  # the same 64 bits
        seeds[upload(rows, device)] = upload(bits, device)
    fill = get_backend("sample_uniform", resolve("sample_uniform", backend, device.type))
    return fill(seeds, vocab)
