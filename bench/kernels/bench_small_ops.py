"""Triton small ops (RMSNorm + residual, RoPE, KV-cache stores with FP8 quantisation, the indexer
key's norm + rope + rotation + store, a gated MLP's SiLU·mul) and the MoE router's logits on the tensor cores ("bf16x3")
against their torch references, at GLM-5 shapes on one GPU.

    PYTHONPATH=pyworker python bench/kernels/bench_small_ops.py [--out bench/results] [--tokens 1,64,1024,16384]

Each case is timed as CUDA-graph replays (so launch gaps shrink to what a captured decode step
pays) rotating over enough input sets that they do not sit in L2. "GB/s" counts the fewest bytes
the op must move (inputs read once, outputs written once) over the Triton time; "of copy" is that
over the device-to-device copy bandwidth measured in the same run. At one token every op is a
single launch of a few KB: the time is the launch floor, not bandwidth.
"""

from __future__ import annotations

import argparse
import math

import torch
from bench_common import ceilings, copy_bandwidth, graph_time_us, print_table, write_results

from nsaserve.kernels import kv_cache_format as fmt
from nsaserve.kernels.registry import get_backend
from nsaserve.kernels.rope import rope_cos_sin
from nsaserve.kernels.router_logits import split_bf16x3
from nsaserve.kernels.small_ops import IndexKeyPrep

HIDDEN, Q_LORA, KV_LORA, ROPE, NOPE, HEADS, IDX_HEADS, IDX_DIM = 6144, 2048, 512, 64, 192, 64, 32, 128
EXPERTS = 256
DENSE_INTER, SHARED_INTER = 12288, 2048  # GLM-5's dense MLP and shared-expert intermediate sizes
PAGE = 64
L2_BYTES = 60 << 20
BF16 = torch.bfloat16


def cases(n: int):
    """(name, bytes moved, make_inputs() -> args, kind[, fast backend: default "triton"]); inputs
    built fresh per rotated set."""
    pos = lambda: torch.randint(0, 100000, (n,), device="cuda")  # noqa: E731
    inv = 1e6 ** (-torch.arange(0, ROPE, 2, dtype=torch.float32, device="cuda") / ROPE)
    cs = lambda: rope_cos_sin(pos(), inv)  # noqa: E731
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=BF16)  # noqa: E731
    w = lambda h: rnd(h) + 1  # noqa: E731
    num_slots = max(4 * n, 4096)

    def slots():
        return torch.randperm(num_slots, device="cuda")[:n]

    latent_fp8 = fmt.alloc_latent(num_slots, KV_LORA, ROPE, True, BF16, "cuda")
    latent_bf16 = fmt.alloc_latent(num_slots, KV_LORA, ROPE, False, BF16, "cuda")
    index_fp8 = fmt.alloc_index_k(num_slots // PAGE, PAGE, IDX_DIM, True, BF16, "cuda")
    yield "rmsnorm h6144", 2 * n * HIDDEN * 2, lambda: (rnd(n, HIDDEN), w(HIDDEN), 1e-5), "rmsnorm"
    yield "add+rmsnorm h6144", 4 * n * HIDDEN * 2, lambda: (rnd(n, HIDDEN), w(HIDDEN), 1e-5, rnd(n, HIDDEN)), "rmsnorm"
    yield "rmsnorm q_a 2048", 2 * n * Q_LORA * 2, lambda: (rnd(n, Q_LORA), w(Q_LORA), 1e-6), "rmsnorm"
    yield (
        "rmsnorm kv_a 512 (strided)", 2 * n * KV_LORA * 2,
        lambda: (rnd(n, KV_LORA + ROPE)[:, :KV_LORA], w(KV_LORA), 1e-6), "rmsnorm",
    )  # fmt: skip
    rope_bytes = lambda heads: n * heads * ROPE * 2 * 2 + n * ROPE * 4  # noqa: E731
    for inter in (True, False):
        tag = "interleaved" if inter else "half-split"
        yield (
            f"rope q_pe 64x64 {tag}", rope_bytes(HEADS),
            lambda inter=inter: (rnd(n, HEADS, NOPE + ROPE)[..., NOPE:], *cs(), inter), "rope",
        )  # fmt: skip
    yield "rope k_pe 64 interleaved", rope_bytes(1), lambda: (rnd(n, KV_LORA + ROPE)[:, KV_LORA:], *cs(), True), "rope"
    yield (
        "rope indexer q 32x128 (first 64)", n * IDX_HEADS * IDX_DIM * 2 * 2 + n * ROPE * 4,
        lambda: (rnd(n, IDX_HEADS, IDX_DIM), *cs(), True), "rope",
    )  # fmt: skip
    yield (
        "rope + rotation indexer q 32x128 (fp8 cache; float32 out)", n * IDX_HEADS * IDX_DIM * (2 + 4) + n * ROPE * 4,
        lambda: (rnd(n, IDX_HEADS, IDX_DIM), *cs(), True, True), "rope",
    )  # fmt: skip
    # kv_store = kv_a_layernorm of the latent + RoPE of k_pe + the store (kv_a_proj output in).
    store_in = n * (KV_LORA + ROPE) * 2 + n * 8 + n * ROPE * 4
    kv_args = lambda cache: (cache, slots(), rnd(n, KV_LORA + ROPE), w(KV_LORA), 1e-6, *cs(), True)  # noqa: E731
    yield "kv_store fp8 656 B (norm+rope+store)", store_in + n * 656, lambda: kv_args(latent_fp8), "kv_store"
    yield "kv_store bf16 1152 B (norm+rope+store)", store_in + n * 1152, lambda: kv_args(latent_bf16), "kv_store"
    yield (
        "index_key_store fp8 132 B", n * IDX_DIM * 2 + n * 8 + n * (IDX_DIM + 4),
        lambda: (index_fp8, slots(), rnd(n, IDX_DIM), PAGE), "index_key_store",
    )  # fmt: skip
    # The indexer key from wk's output: LayerNorm + RoPE of the first 64 dims + Hadamard rotation +
    # the fp8 store (torch: the composition of the reference ops, nine launches).
    k_norm = (w(IDX_DIM), rnd(IDX_DIM) * 0.1)
    yield (
        "index_key_store fp8 132 B (norm+rope+rotate+store)", n * IDX_DIM * 2 + n * 8 + n * ROPE * 4 + n * (IDX_DIM + 4),
        lambda: (index_fp8, slots(), rnd(n, IDX_DIM), PAGE, IndexKeyPrep(*k_norm, 1e-6, *cs(), True, True)),
        "index_key_store",
    )  # fmt: skip
    # A gated MLP's silu(gate) * up from its stacked gate/up GEMM output (torch: silu, then the product).
    for inter, tag in ((DENSE_INTER, "dense"), (SHARED_INTER, "shared expert")):
        yield f"silu*mul {tag} 2x{inter}", n * 3 * inter * 2, lambda inter=inter: (rnd(n, 2 * inter),), "silu_mul"
    # The router: x bf16 against the float32 weight (torch: a float32 GEMM) or its three bf16 parts.
    router_w = torch.randn(EXPERTS, HIDDEN, device="cuda") * HIDDEN**-0.5
    router_split = split_bf16x3(router_w)
    yield (
        "router logits 256 x 6144", n * HIDDEN * 2 + router_split.numel() * 2 + n * EXPERTS * 4,
        lambda: (rnd(n, HIDDEN), router_w, router_split), "router_logits", "bf16x3",
    )  # fmt: skip


def measure(n: int, copy_bps: float) -> list[dict]:
    rows = []
    for name, nbytes, make, kind, *fast in cases(n):
        fast = fast[0] if fast else "triton"
        sets = max(2, min(16, math.ceil(3 * L2_BYTES / max(1, nbytes))))
        inputs = [make() for _ in range(sets)]
        row = {"op": name, "tokens": n, "bytes": nbytes, "fast": fast}
        for backend, col in (("torch", "torch_us"), (fast, "fast_us")):
            fn = get_backend(kind, backend)
            row[col] = graph_time_us([lambda a=a, fn=fn: fn(*a) for a in inputs])
        row["speedup"] = row["torch_us"] / row["fast_us"]
        row["GBps"] = nbytes / (row["fast_us"] * 1e-6) / 1e9
        row["of_copy"] = nbytes / (row["fast_us"] * 1e-6) / copy_bps
        print(row, flush=True)  # partial results survive a timeout
        rows.append(row)
        del inputs
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tokens", default="1,64,1024,16384")
    ap.add_argument("--name", default="small-ops")
    args = ap.parse_args()
    copy_bps = copy_bandwidth()
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        rows += measure(n, copy_bps)
    cols = ["op", "tokens", "torch_us", "fast", "fast_us", "speedup", "GBps", "of_copy"]
    notes = (
        "Times: median of CUDA-graph replays, rotating input sets past L2. fast: the backend timed "
        "against torch's (Triton, or bf16x3 for the router logits). GBps = fewest bytes (inputs "
        "once, outputs once) / the fast time; of_copy = that / copy bandwidth of this run (the "
        "router logits at many tokens are bound by the matmul rate, not by bytes)."
    )
    stem = write_results(args.name, args.out, ceilings(copy_bps), rows, cols, notes)
    print(f"copy bandwidth {copy_bps / 1e12:.2f} TB/s; results: {stem}.{{json,md}}")
    print_table(rows, cols)


if __name__ == "__main__":
    main()
