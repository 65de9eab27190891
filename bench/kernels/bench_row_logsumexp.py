"""Each row's log-sum-exp ("row_logsumexp", the logprobs' normaliser) at GLM-5's vocabulary
(154,880) on one GPU: the torch reference (a float32 copy, then torch.logsumexp) against the Triton
backend (two reads of each row in its own dtype).

    PYTHONPATH=pyworker python bench/kernels/bench_row_logsumexp.py [--out bench/results] [--rows 1,64,256,1024]

bf16 rows, as the decode graphs hand them over, and float32 rows. CUDA-graph replays over two
input sets. floor_us: one read of the rows at the copy bandwidth measured in the same run; reads =
time / floor. max_err: the largest difference between the two backends' answers.
"""

from __future__ import annotations

import torch
from bench_common import graph_time_us, run_per_rows

from nsaserve.kernels.row_logsumexp import row_logsumexp_torch
from nsaserve.kernels.triton_row_logsumexp import row_logsumexp_triton

VOCAB = 154880


def case(rows: int, dtype: torch.dtype, copy_bps: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    sets = [(torch.randn(rows, VOCAB, generator=gen, device="cuda") * 4).to(dtype) for _ in range(2)]
    err = max((row_logsumexp_triton(x) - row_logsumexp_torch(x)).abs().max().item() for x in sets)
    floor_us = rows * VOCAB * sets[0].element_size() / copy_bps * 1e6
    out = []
    for name, fn in (("torch reference", row_logsumexp_torch), ("triton", row_logsumexp_triton)):
        us = graph_time_us([lambda x=x, fn=fn: fn(x) for x in sets])
        out.append({"rows": rows, "dtype": str(dtype).removeprefix("torch."), "variant": name, "us": us,
                    "floor_us": floor_us, "reads": us / floor_us, "max_err": err})  # fmt: skip
    out[1]["speedup"] = out[0]["us"] / out[1]["us"]
    return out


def main() -> None:
    cols = ["rows", "dtype", "variant", "us", "speedup", "floor_us", "reads", "max_err"]
    notes = f"vocabulary {VOCAB}; floor: the rows read once at the copy bandwidth."
    run_per_rows("row-logsumexp", case, [(torch.bfloat16,), (torch.float32,)], cols, notes)


if __name__ == "__main__":
    main()
