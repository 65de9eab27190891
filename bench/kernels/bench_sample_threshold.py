"""The sampler's filters as one threshold per row ("sample_threshold") at GLM-5's vocabulary
(154,880) on one GPU: the torch reference (a sort of every row) against the Triton backend (a few
streaming passes, a search over the values near the cut).

    PYTHONPATH=pyworker python bench/kernels/bench_sample_threshold.py [--out bench/results] [--rows 1,64,256,1024]

bf16 logits, as the decode graphs hand them over. Filters: `top_p` (temperature 1, top-p 0.95: a
typical generation_config.json), `top_k` (temperature 0.7, top-k 20), `mixed` (temperature 0.7,
top-k 50, top-p 0.9, min-p 0.05). Logits: `gaussian` (N(0, 4^2): the top-p nucleus spans
thousands of tokens, so its ladder step needs refining), `flat` (N(0, 1), as a randomly
initialised model's: top-p 0.95 keeps about three quarters of the row) and `peaked` (N(0, 1)
plus 12 on every 40th token of the row's first 3,872: a few hundred likely tokens). Timed as
CUDA-graph replays over two input sets. floor_us: one read of the logits at the copy bandwidth measured in the same
run; reads = time / floor (how many passes' worth of time the kernels take). `differ`: rows whose
threshold differs from the reference's (top-p cuts within float32 rounding of top_p only).
"""

from __future__ import annotations

import torch
from bench_common import graph_time_us, run_per_rows

from nsaserve.kernels.sample_threshold import sample_threshold_torch
from nsaserve.kernels.triton_sample_threshold import sample_threshold_triton

VOCAB = 154880
FILTERS = {  # temperature, top_k, top_p, min_p
    "top_p": (1.0, 0, 0.95, 0.0),
    "top_k": (0.7, 20, 1.0, 0.0),
    "mixed": (0.7, 50, 0.9, 0.05),
}


def logits(rows: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, VOCAB, generator=gen, device="cuda")
    if kind == "gaussian":
        x *= 4
    elif kind == "peaked":
        x[:, : 40 * 97 : 40] += 12.0
    return x.bfloat16()


def case(rows: int, kind: str, filt: str, copy_bps: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    t, k, p, mp = FILTERS[filt]
    args = [
        torch.full((rows,), v, device="cuda", dtype=dt)
        for v, dt in ((t, None), (k, torch.int64), (p, None), (mp, None))
    ]
    sets = [(logits(rows, kind, gen), *args) for _ in range(2)]
    differ = sum(int((sample_threshold_triton(*s) != sample_threshold_torch(*s)).sum()) for s in sets)
    floor_us = rows * VOCAB * 2 / copy_bps * 1e6
    out = []
    for name, fn in (("torch reference (sort)", sample_threshold_torch), ("triton", sample_threshold_triton)):
        us = graph_time_us([lambda s=s, fn=fn: fn(*s) for s in sets])
        out.append({"rows": rows, "logits": kind, "filters": filt, "variant": name, "us": us, "floor_us": floor_us,
                    "reads": us / floor_us, "differ": differ})  # fmt: skip
    out[1]["speedup"] = out[0]["us"] / out[1]["us"]
    return out


def main() -> None:
    cols = ["rows", "logits", "filters", "variant", "us", "speedup", "floor_us", "reads", "differ"]
    notes = f"vocabulary {VOCAB}, bf16 logits; floor: the logits read once at the copy bandwidth."
    run_per_rows(
        "sample-threshold", case, [(k, f) for k in ("gaussian", "flat", "peaked") for f in FILTERS], cols, notes
    )


if __name__ == "__main__":
    main()
