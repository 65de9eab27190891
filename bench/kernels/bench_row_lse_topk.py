"""Top logprobs' two reductions of each row at GLM-5's vocabulary (154,880) on one GPU: the
log-sum-exp and the k largest logits ("row_lse_topk"). Three ways, CUDA-graph replays over two
input sets:

- torch reference: torch.logsumexp of a float32 copy, then torch.topk;
- before: the Triton "row_logsumexp" kernel (two reads of each row), then torch.topk (the sampler
  up to this kernel);
- triton: both in one read of each row (triton_row_lse_topk.py).

    PYTHONPATH=pyworker python bench/kernels/bench_row_lse_topk.py [--out bench/results] [--rows 1,64,256,1024]

bf16 rows, as the decode graphs hand them over. floor_us: one read of the rows at the copy
bandwidth measured in the same run; reads = time / floor. exact: the Triton top values equal
torch.topk's and its lse is within 2e-6 of the reference's.
"""

from __future__ import annotations

import torch
from bench_common import graph_time_us, run_per_rows

from nsaserve.kernels.row_logsumexp import row_lse_topk_torch
from nsaserve.kernels.triton_row_logsumexp import row_logsumexp_triton
from nsaserve.kernels.triton_row_lse_topk import row_lse_topk_triton

VOCAB = 154880


def _before(x: torch.Tensor, k: int):
    top = x.topk(k, dim=1)
    return row_logsumexp_triton(x), top.values.float(), top.indices


def case(rows: int, k: int, copy_bps: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(rows + k)
    sets = [(torch.randn(rows, VOCAB, generator=gen, device="cuda") * 4).to(torch.bfloat16) for _ in range(2)]
    exact = True
    for x in sets:
        lse, vals, _ = row_lse_topk_triton(x, k)
        want_lse, want_vals, _ = row_lse_topk_torch(x, k)
        exact &= bool(torch.equal(vals, want_vals)) and (lse - want_lse).abs().max().item() <= 2e-6 * max(1.0, want_lse.abs().max().item())
    floor_us = rows * VOCAB * sets[0].element_size() / copy_bps * 1e6
    out = []
    variants = (("torch reference", row_lse_topk_torch), ("before (triton lse + torch.topk)", _before), ("triton", row_lse_topk_triton))
    for name, fn in variants:
        us = graph_time_us([lambda x=x, fn=fn: fn(x, k) for x in sets])
        out.append({"rows": rows, "k": k, "variant": name, "us": us, "floor_us": floor_us, "reads": us / floor_us, "exact": exact})
    for o in out[1:]:
        o["speedup"] = out[0]["us"] / o["us"]
    out[2]["vs_before"] = out[1]["us"] / out[2]["us"]
    return out


def main() -> None:
    cols = ["rows", "k", "variant", "us", "speedup", "vs_before", "floor_us", "reads", "exact"]
    notes = f"vocabulary {VOCAB}, bf16 rows; floor: the rows read once at the copy bandwidth."
    run_per_rows("row-lse-topk", case, [(5,), (20,)], cols, notes)


if __name__ == "__main__":
    main()
