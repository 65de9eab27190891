"""Repetition, frequency and presence penalties ("penalties") at GLM-5's vocabulary (154,880) on one
GPU, every row penalised, each with a history of --history tokens (the last 200 generated) plus
its pending token:

- torch reference: expand the histories into (row, token) pairs, sort them, count and rewrite
  (penalties.py: about fifty small launches);
- triton: one launch, one program per row (triton_penalties.py).

    PYTHONPATH=pyworker python bench/kernels/bench_penalties.py [--out bench/results] [--rows 1,64,256,1024]

graph_us: CUDA-graph replays over two input sets (device time only). eager_us: back-to-back eager
calls, which is what the worker pays where the host is the bottleneck (a one-row decode step):
the host's launch cost included. floor_us: each entry's 4-byte history id read and one 32-byte
sector of its logit read and written, at the copy bandwidth measured in the same run (the entries
land at random places in the rows). exact: the Triton logits equal the reference's bit for bit.
"""

from __future__ import annotations

import argparse

import torch
from bench_common import ceilings, copy_bandwidth, eager_time_us, graph_time_us, print_table, write_results

from nsaserve.kernels.penalties import penalties_torch
from nsaserve.kernels.triton_penalties import penalties_triton

VOCAB = 154880
GENERATED = 200


def make_inputs(rows: int, history: int, seed: int) -> tuple[torch.Tensor, tuple]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    flat = torch.empty(rows * VOCAB + 1, device=dev)
    flat[:-1].normal_(generator=g).mul_(4)
    hist = torch.randint(VOCAB, (rows * history,), generator=g, device=dev, dtype=torch.int32)
    length = torch.full((rows,), history, dtype=torch.int64, device=dev)
    start = torch.arange(rows, device=dev) * history
    prompt = torch.full((rows,), history - GENERATED, dtype=torch.int64, device=dev)
    pending = torch.randint(VOCAB, (rows,), generator=g, device=dev)
    first = torch.arange(rows, device=dev) * (history + 1)
    knobs = [torch.full((rows,), v, device=dev) for v in (1.05, 0.2, 0.1)]
    rows_t = torch.arange(rows, device=dev)
    return flat, (VOCAB, hist, rows_t, start, length, prompt, pending, first, *knobs, rows * history, history)


def case(rows: int, history: int, copy_bps: float) -> list[dict]:
    sets = [make_inputs(rows, history, seed) for seed in (rows, rows + 1)]
    originals = [flat.clone() for flat, _ in sets]
    exact = True
    for (flat, args), orig in zip(sets, originals):
        want = orig.clone()
        penalties_torch(want, *args)
        flat.copy_(orig)
        penalties_triton(flat, *args)
        exact &= bool(torch.equal(flat[:-1], want[:-1]))  # the spare slot takes discarded writes
    # Timing reapplies the penalties to already-penalised logits: the work per call is the same.
    entries = rows * (history + 1)
    floor_us = entries * (4 + 2 * 32) / copy_bps * 1e6
    out = []
    for name, fn in (("torch reference", penalties_torch), ("triton", penalties_triton)):
        calls = [lambda flat=flat, args=args, fn=fn: fn(flat, *args) for flat, args in sets]
        graph_us = graph_time_us(calls)
        eager_us = eager_time_us(calls[0])
        out.append({"rows": rows, "history": history, "variant": name, "graph_us": graph_us, "eager_us": eager_us,
                    "floor_us": floor_us, "ratio": graph_us / floor_us, "exact": exact})  # fmt: skip
    out[1]["graph_speedup"] = out[0]["graph_us"] / out[1]["graph_us"]
    out[1]["eager_speedup"] = out[0]["eager_us"] / out[1]["eager_us"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--rows", default="1,64,256,1024")
    ap.add_argument("--history", default="1400", help="history lengths, comma-separated")
    args = ap.parse_args()
    copy_bps = copy_bandwidth()
    measured = ceilings(copy_bps)
    rows = []
    for r in (int(v) for v in args.rows.split(",")):
        for h in (int(v) for v in args.history.split(",")):
            got = case(r, h, copy_bps)
            rows += got
            for line in got:
                print(line, flush=True)
        torch.cuda.empty_cache()
    cols = "rows history variant graph_us eager_us graph_speedup eager_speedup floor_us ratio exact".split()
    print_table(rows, cols)
    notes = (
        f"vocabulary {VOCAB}, float32 logits, every row penalised (repetition 1.05, frequency 0.2, presence 0.1), "
        f"histories of `history` tokens ({GENERATED} generated) plus a pending token; floor: 4 + 2 x 32 bytes per entry."
    )
    print(write_results("penalties", out_dir=args.out, ceilings=measured, rows=rows, columns=cols, notes=notes))


if __name__ == "__main__":
    main()
