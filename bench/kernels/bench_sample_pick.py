"""The sampler's pick, argmax(x + Gumbel(u)) per row, at GLM-5's vocabulary (154,880) on one GPU:
the torch reference (one tensor per operation) against the fused Triton backend.

    PYTHONPATH=pyworker python bench/kernels/bench_sample_pick.py [--out bench/results] [--rows 1,64,256,1024]

Timed as CUDA-graph replays over two input sets. floor_us: the bytes the pick must read (x and u,
float32) over the copy bandwidth measured in the same run; of_floor: floor over the time. Every
case also checks that both backends pick the same tokens.
"""

from __future__ import annotations

import torch
from bench_common import graph_time_us, run_per_rows

from nsaserve.kernels.sample_pick import sample_pick_torch
from nsaserve.kernels.triton_sample_pick import pieces_for, sample_pick_triton

VOCAB = 154880


def case(rows: int, copy_bps: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    sets = []
    for _ in range(2):
        x = torch.randn(rows, VOCAB, generator=gen, device="cuda") * 4
        u = torch.rand(rows, VOCAB, generator=gen, device="cuda")
        sets.append((x, u))
    same = all(torch.equal(sample_pick_triton(x, u), sample_pick_torch(x, u)) for x, u in sets)
    floor_us = rows * VOCAB * 8 / copy_bps * 1e6
    out = []
    for name, fn in (("torch reference", sample_pick_torch), ("triton (fused)", sample_pick_triton)):
        us = graph_time_us([lambda x=x, u=u, fn=fn: fn(x, u) for x, u in sets])
        out.append({"rows": rows, "variant": name, "us": us, "floor_us": floor_us, "of_floor": floor_us / us,
                    "pieces": pieces_for(rows, VOCAB) if "triton" in name else None, "same_tokens": same})  # fmt: skip
    out[1]["speedup"] = out[0]["us"] / out[1]["us"]
    # Temperature: divided first in torch (the sampler before) against inside the pick (plain batches).
    t = torch.rand(rows, generator=gen, device="cuda") + 0.5
    same_t = all(
        torch.equal(sample_pick_triton(x, u, None, t), sample_pick_triton(x.float() / t.unsqueeze(1), u))
        for x, u in sets
    )
    tries = (
        ("temperature: torch divide, then triton pick", lambda x, u: sample_pick_triton(x.float() / t.unsqueeze(1), u)),
        ("temperature: folded into the triton pick", lambda x, u: sample_pick_triton(x, u, None, t)),
    )
    for name, fn in tries:
        us = graph_time_us([lambda x=x, u=u, fn=fn: fn(x, u) for x, u in sets])
        out.append({"rows": rows, "variant": name, "us": us, "floor_us": floor_us, "of_floor": floor_us / us,
                    "pieces": pieces_for(rows, VOCAB), "same_tokens": same_t})  # fmt: skip
    out[3]["speedup"] = out[2]["us"] / out[3]["us"]
    return out


def main() -> None:
    cols = ["rows", "variant", "us", "speedup", "floor_us", "of_floor", "pieces", "same_tokens"]
    notes = f"vocabulary {VOCAB}; floor: x and u read once (float32) at the copy bandwidth."
    run_per_rows("sample-pick", case, [()], cols, notes)


if __name__ == "__main__":
    main()
