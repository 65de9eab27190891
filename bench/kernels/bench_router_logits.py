"""MoE router logits at GLM-5 shapes (256 experts x 6144 inputs) on one GPU: the float32 GEMM against
"bf16x3" (the weight as three bf16 parts on the tensor cores) with the high part's accumulation
chain cut into pieces of a given size (HI_CHUNK_K), for several sizes, at every token count (the
model takes the float32 GEMM below FLOAT32_BELOW tokens), and the Triton kernel over the same
parts in one launch (triton_router_logits.py, chains of its BLOCK_K). Per case: time (CUDA-graph replays
over rotated inputs), the largest error against a float64 product, and that error over the
float32 GEMM's (the reference the model defines).

    PYTHONPATH=pyworker python bench/kernels/bench_router_logits.py [--out bench/results] [--tokens 1,8,16,32,64,256,4096,16384]

The errors are the largest over --seeds draws of x and W (W at the 1/sqrt(H) scale of a trained
router, times a log-uniform factor over 2^-4..2^4 per row: experts differ in norm).
"""

from __future__ import annotations

import argparse

import torch
from bench_common import bf16_matmul_rate, copy_bandwidth, graph_time_us, print_table, write_results

from nsaserve.kernels import router_logits as rl
from nsaserve.kernels.triton_router_logits import BLOCK_K, router_logits_triton

HIDDEN, EXPERTS = 6144, 256
CHUNKS = (None, 1024, 512, 384, 256)
L2_BYTES = 60 << 20


def draw(tokens: int, gen: torch.Generator):
    x = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    row_scale = torch.exp2(torch.rand(EXPERTS, 1, generator=gen, device="cuda") * 8 - 4)
    w = torch.randn(EXPERTS, HIDDEN, generator=gen, device="cuda") * HIDDEN**-0.5 * row_scale
    return x, w


def case(tokens: int, seeds: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    err = {"float32 GEMM": 0.0, **{f"bf16x3 chunk {c}": 0.0 for c in CHUNKS}, "triton": 0.0}
    for _ in range(seeds):
        x, w = draw(tokens, gen)
        exact = x.double() @ w.double().t()
        scale = exact.abs().max().item()
        split = rl.split_bf16x3(w)
        err["float32 GEMM"] = max(
            err["float32 GEMM"], (rl.router_logits_torch(x, w).double() - exact).abs().max().item() / scale
        )
        for c in CHUNKS:
            rl.HI_CHUNK_K = c
            got = rl.router_logits_bf16x3(x, w, split).double()
            err[f"bf16x3 chunk {c}"] = max(err[f"bf16x3 chunk {c}"], (got - exact).abs().max().item() / scale)
        got = router_logits_triton(x, w, split).double()
        err["triton"] = max(err["triton"], (got - exact).abs().max().item() / scale)
    # Timing: enough input sets that one replay does not find the last one's x in L2.
    sets = max(2, min(16, L2_BYTES // (tokens * HIDDEN * 2) + 1))
    inputs = [draw(tokens, gen) for _ in range(sets)]
    w, split = inputs[0][1], rl.split_bf16x3(inputs[0][1])
    rows = []
    ref_us = graph_time_us([lambda x=x: rl.router_logits_torch(x, w) for x, _ in inputs])
    rows.append(
        {"tokens": tokens, "variant": "float32 GEMM", "us": ref_us, "rel_err": err["float32 GEMM"], "err_vs_fp32": 1.0}
    )
    for c in CHUNKS:
        rl.HI_CHUNK_K = c
        us = graph_time_us([lambda x=x: rl.router_logits_bf16x3(x, w, split) for x, _ in inputs])
        e = err[f"bf16x3 chunk {c}"]
        rows.append({"tokens": tokens, "variant": f"bf16x3 chunk {c}", "us": us, "rel_err": e,
                     "err_vs_fp32": e / max(err["float32 GEMM"], 1e-30), "speedup": ref_us / us})  # fmt: skip
    us = graph_time_us([lambda x=x: router_logits_triton(x, w, split) for x, _ in inputs])
    e = err["triton"]
    rows.append({"tokens": tokens, "variant": f"triton (chains of {BLOCK_K})", "us": us, "rel_err": e,
                 "err_vs_fp32": e / max(err["float32 GEMM"], 1e-30), "speedup": ref_us / us})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tokens", default="1,8,16,32,64,256,4096,16384")
    ap.add_argument("--seeds", type=int, default=4)
    args = ap.parse_args()
    ceilings = {"copy_TBps": copy_bandwidth() / 1e12, "bf16_TFLOPs": bf16_matmul_rate() / 1e12}
    default = rl.HI_CHUNK_K
    below, rl.FLOAT32_BELOW = rl.FLOAT32_BELOW, 0  # the bf16 GEMMs at every token count
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        rows += case(t, args.seeds)
        print(rows[-1], flush=True)
    rl.HI_CHUNK_K, rl.FLOAT32_BELOW = default, below
    cols = ["tokens", "variant", "us", "speedup", "rel_err", "err_vs_fp32"]
    print_table(rows, cols)
    notes = (
        "rel_err: largest |logit - float64 logit| over the largest |float64 logit|, over the seeds; "
        f"err_vs_fp32: that over the float32 GEMM's. The model's most inputs per chain: {default} (chains of "
        f"hi_chunk({HIDDEN}) = {rl.hi_chunk(HIDDEN)}); below {below} tokens it takes the float32 GEMM."
    )
    print(write_results("router-logits", args.out, ceilings, rows, cols, notes))


if __name__ == "__main__":
    main()
