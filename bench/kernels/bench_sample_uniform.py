"""The sampler's uniforms ("sample_uniform") at GLM-5's vocabulary (154,880) on one GPU: the
Triton backend (a Philox stream per row's seed, every row in one launch) against what the sampler
did before it and against the torch reference.

    PYTHONPATH=pyworker python bench/kernels/bench_sample_uniform.py [--out bench/results] [--rows 1,64,256,1024]

Variants:
- `torch.rand` (one draw for the batch: how unseeded rows were filled), a CUDA-graph replay;
- `generator per row` (how each seeded row was filled: a torch.Generator seeded, then torch.rand
  into the row), eager, every row seeded: host time dominates;
- `torch reference` (Philox in int64 tensor operations) and `triton`, CUDA-graph replays.
floor_us: the uniforms written once (rows x vocab x 4 bytes) at the copy bandwidth measured in the
same run; writes = time / floor. `exact`: the Triton values equal the reference's bit for bit.
"""

from __future__ import annotations

import torch
from bench_common import eager_time_us, graph_time_us, run_per_rows

from nsaserve.kernels.sample_uniform import sample_uniform_torch
from nsaserve.kernels.triton_sample_uniform import sample_uniform_triton

VOCAB = 154880


def per_row_generators(seeds: list[int], out: torch.Tensor) -> None:
    for row, s in enumerate(seeds):
        g = torch.Generator(device="cuda")
        g.manual_seed(s)
        torch.rand(VOCAB, generator=g, device="cuda", out=out[row])


def case(rows: int, copy_bps: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    seeds = [
        torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen, device="cuda", dtype=torch.int64) for _ in range(2)
    ]
    exact = all(torch.equal(sample_uniform_triton(s, VOCAB), sample_uniform_torch(s, VOCAB)) for s in seeds)
    floor_us = rows * VOCAB * 4 / copy_bps * 1e6
    out_buf = torch.empty(rows, VOCAB, device="cuda")
    host_seeds = [v & ((1 << 63) - 1) for v in seeds[0].tolist()]
    timings = {
        "torch.rand (one draw)": graph_time_us([lambda: torch.rand(rows, VOCAB, device="cuda") for _ in range(2)]),
        "generator per row (eager)": eager_time_us(
            lambda: per_row_generators(host_seeds, out_buf), reps=5 if rows > 64 else 20
        ),
        "torch reference": graph_time_us([lambda s=s: sample_uniform_torch(s, VOCAB) for s in seeds], reps=5),
        "triton": graph_time_us([lambda s=s: sample_uniform_triton(s, VOCAB) for s in seeds]),
    }
    out = [{"rows": rows, "variant": k, "us": us, "floor_us": floor_us, "writes": us / floor_us, "exact": exact}
           for k, us in timings.items()]  # fmt: skip
    for r in out:
        r["triton_speedup"] = r["us"] / timings["triton"]
    return out


def main() -> None:
    cols = ["rows", "variant", "us", "triton_speedup", "floor_us", "writes", "exact"]
    notes = f"vocabulary {VOCAB}; floor: the float32 uniforms written once at the copy bandwidth."
    run_per_rows("sample-uniform", case, [()], cols, notes)


if __name__ == "__main__":
    main()
