"""Host time of the eager forward step of a GLM-5-shaped model on one GPU: enqueue, GPU and wall.

    PYTHONPATH=pyworker:bench/kernels python bench/kernels/bench_step_host.py --out bench/results \\
        [--dense-layers 1 --moe-layers 2] [--batches 1,64,256] [--context 1536] [--paths lookup,resolved]

The model is built directly on the device (GLM-5 layer shapes, NVFP4 routed experts, bf16
elsewhere, random weights; no checkpoint is written) with an FP8 KV cache whose pages hold random
finite values, and the default CUDA kernels (Triton attention, indexer, small ops, routing and
NVFP4 MoE). Cases: decode at each batch with --context cached tokens per request, a mixed step
(one --mixed-prompt token prompt + --mixed-decodes decodes) and a prefill of --prefill tokens.
Per case and host path (PATHS below: "lookup" = a registry lookup per kernel call and the op
sequence before, "resolved" = kernels resolved once; a third, shorter Triton launch path was
measured once and removed: no gain within the host's noise), medians over --rounds x --iters steps with the paths interleaved
(time_case says how each is taken):
enqueue_ms (host time of the call), gpu_busy_ms (device time alone), wall_ms (back-to-back steps),
host_waits (whether the call ever waits for the device), host/gpu (> 1: host-bound).
The ForwardBatch is built outside the timed region (the worker builds it before the forward).
One decode step is also profiled with torch.profiler: its top host ops go to the results.
Ceilings measured in the same run: copy bandwidth and bf16 matmul rate (bench_common).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from bench_common import bf16_matmul_rate, copy_bandwidth, machine, print_table, write_results

from nsaserve.kernels.quant.make_checkpoint import _quantization_config
from nsaserve.kernels.quant.make_glm5_shaped import glm5_config
from nsaserve.kernels.quant.precision import ALWAYS_BF16
from nsaserve.model import model as model_mod
from nsaserve.model.config import parse_config
from nsaserve.model.kv_pool import KVPool
from nsaserve.model.mlp import MoE
from nsaserve.model.model import CausalLM
from nsaserve.model.parallel import TPGroup
from nsaserve.protocol.builder import RequestSpec, SamplingSpec, build_plan
from nsaserve.worker.batch import build_forward_batch

PAGE = 64
# torch.cuda._sleep counts GPU clock cycles; the H200 runs at up to 1.98 GHz (a longer spin is harmless).
SPIN_CYCLES_PER_S = 2.0e9
CUDA_BACKENDS = {
    "attention": "triton", "indexer": "triton", "rmsnorm": "triton", "rope": "triton", "kv_store": "triton",
    "index_key_store": "triton", "moe_route": "triton", "moe_experts": "triton",
}  # fmt: skip


# Host paths: CausalLM.resolve_kernels.
PATHS = {"lookup": False, "resolved": True}
PATHS_DOC = (
    f"lookup = a registry lookup per kernel call and the op sequence before ({model_mod.HOST_PATH_ENV}=lookup); "
    f"resolved = kernels resolved once"
)


def set_path(model, path: str) -> None:
    model.resolve_kernels = PATHS[path]


def build_model(dense_layers: int, moe_layers: int, device, overrides: dict | None = None):
    """A GLM-5-shaped CausalLM with random weights drawn on the device: bf16 Linears with std
    1/sqrt(fan_in), unit norms, NVFP4 experts with random codes and block scales near 1/sqrt(fan_in)."""
    raw = glm5_config(moe_layers, dense_layers, overrides)
    ignore = list(ALWAYS_BF16) + ["*self_attn*", "*shared_experts*"]
    ignore += [f"model.layers.{i}.mlp" for i, t in enumerate(raw["mlp_layer_types"]) if t == "dense"]
    qc, hf = _quantization_config("nvfp4", ignore)
    cfg = parse_config(raw | {"quantization_config": qc}, hf)
    model = CausalLM(cfg, TPGroup(), dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype == torch.uint8:  # e2m1 code pairs: every byte is valid
                p.random_(0, 256, generator=gen)
            elif p.dtype == torch.float8_e4m3fn:  # block scales: the codes reach 6, so ~1/(6 sqrt(in))
                in_features = p.shape[-1] * 16
                p.copy_(torch.full(p.shape, in_features**-0.5 / 6, device=device).to(p.dtype))
            elif name.endswith("weight_scale_2"):
                p.fill_(1.0)
            elif "norm" in name and name.endswith("bias"):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.01, generator=gen)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0, generator=gen)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    model.eval()
    model.backends.update(CUDA_BACKENDS)
    return model, cfg


def random_pool(cfg, num_pages: int, device) -> KVPool:
    """An FP8 pool whose bytes are random with bit 6 of every byte clear: e4m3 codes, float32
    scales and bf16 k_pe all finite and below 2 in magnitude (as if many requests had run)."""
    pool = KVPool(cfg, num_pages=num_pages, page_size=PAGE, kv_cache_dtype="fp8_e4m3", dtype=torch.bfloat16,
                  device=device)  # fmt: skip
    for t in pool.latent + [k for k in pool.index_k if k is not None]:
        t.random_(0, 256)
        t.bitwise_and_(0xBF)
    return pool


class Plans:
    """Decode, mixed and prefill plans over disjoint pages of one pool."""

    def __init__(self, vocab: int, seed: int = 0):
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.next_page = 0

    def pages(self, tokens: int) -> list[int]:
        n = -(-tokens // PAGE)
        out = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        return out

    def spec(self, rid: int, new: int, cached: int, pages: list[int]) -> RequestSpec:
        ids = [self.rng.randrange(self.vocab) for _ in range(new)]
        return RequestSpec(rid, ids, cached, pages, sampling=SamplingSpec(temperature=0.0))

    def decode(self, batch: int, context: int) -> list[RequestSpec]:
        return [self.spec(i, 1, context, self.pages(context + 1)) for i in range(batch)]

    def prefill(self, rid: int, tokens: int) -> RequestSpec:
        return self.spec(rid, tokens, 0, self.pages(tokens))


def time_case(model, pool, batch, iters: int, samples: dict | None = None) -> dict:
    """Adds `iters` samples of each measure to `samples` (a dict of lists) and returns it:
    enqueue (host time of the call, the GPU idle at its start), gpu (CUDA events around the call,
    GPU idle at its start: includes gaps where the GPU waits for the host), gpu_busy (the same
    events while a spin kernel holds the GPU until the whole step is queued: the device time
    alone, no host gaps), enqueue_blocked (host time of the call while the GPU is held by that
    spin: longer than the spin only if the forward waits for the device), and wall (back-to-back
    steps, synchronised once; one sample per call of this function)."""
    samples = samples if samples is not None else {}
    add = lambda k, v: samples.setdefault(k, []).append(v)  # noqa: E731
    model(batch, pool)
    for _ in range(iters):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t0 = time.perf_counter()
        model(batch, pool)
        add("enqueue_ms", (time.perf_counter() - t0) * 1e3)
        e1.record()
        e1.synchronize()
        add("gpu_ms", e0.elapsed_time(e1))
    spin_ms = 4 * statistics.median(samples["enqueue_ms"]) + 20
    for _ in range(max(1, iters // 2)):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(spin_ms * 1e-3 * SPIN_CYCLES_PER_S))
        e0.record()
        t0 = time.perf_counter()
        model(batch, pool)
        blocked = (time.perf_counter() - t0) * 1e3
        add("enqueue_blocked_ms", blocked)
        add("host_waits", blocked > 0.5 * spin_ms)
        e1.record()
        e1.synchronize()
        add("gpu_busy_ms", e0.elapsed_time(e1))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        model(batch, pool)
    torch.cuda.synchronize()
    add("wall_ms", (time.perf_counter() - t0) * 1e3 / iters)
    return samples


def summarize(samples: dict) -> dict:
    out = {k: statistics.median(v) for k, v in samples.items() if k != "host_waits"}
    out["host_waits"] = any(samples.get("host_waits", []))
    return out


def host_breakdown(model, pool, batch, spin_ms: float, reps: int = 5) -> dict:
    """Host milliseconds per step spent in each kind of module (summed over layers; attention
    without its indexer), the GPU held by a spin kernel so that nothing waits for it."""
    acc, start, handles = {}, {}, []

    def pre(mod, args):
        start[id(mod)] = time.perf_counter()

    def post(name):
        def hook(mod, args, out):
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - start.pop(id(mod))

        return hook

    for layer in model.model.layers:
        mlp = "moe" if isinstance(layer.mlp, MoE) else "dense_mlp"
        for name, mod in (("attention", layer.self_attn), ("indexer", layer.self_attn.indexer), (mlp, layer.mlp)):
            if mod is not None:
                handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post(name))]
    total = 0.0
    try:
        for _ in range(reps):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(spin_ms * 1e-3 * SPIN_CYCLES_PER_S))
            t0 = time.perf_counter()
            model(batch, pool)
            total += time.perf_counter() - t0
        torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    out = {k: v * 1e3 / reps for k, v in acc.items()}
    out["attention"] -= out.get("indexer", 0.0)
    out["total"] = total * 1e3 / reps
    out["rest"] = out["total"] - sum(v for k, v in out.items() if k != "total")
    return out


def top_host_ops(model, pool, batch, n: int = 25) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    model(batch, pool)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(batch, pool)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        rows.append({
            "op": e.key, "calls": e.count, "cpu_total_us": e.cpu_time_total, "self_cpu_us": e.self_cpu_time_total,
            "device_us": getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0)),
        })  # fmt: skip
    rows.sort(key=lambda r: -r["self_cpu_us"])
    return rows[:n]


def launch_costs(device) -> dict:
    """Host microseconds per call of a few single ops (the GPU idle; medians of 200 calls)."""
    from nsaserve.kernels.registry import get_backend, load_backend

    x = torch.randn(64, 6144, device=device, dtype=torch.bfloat16)
    w = torch.ones(6144, device=device, dtype=torch.bfloat16)
    q = torch.randn(64, 64, 192, device=device, dtype=torch.bfloat16)
    wk = torch.randn(64, 192, 512, device=device, dtype=torch.bfloat16)
    lin = torch.randn(2048, 6144, device=device, dtype=torch.bfloat16)
    rms = load_backend("rmsnorm", "triton")
    cases = {
        "torch.empty": lambda: torch.empty(64, 6144, device=device),
        "add": lambda: x + x,
        "F.linear 64x6144x2048": lambda: torch.nn.functional.linear(x, lin),
        "einsum thn,hnr->thr": lambda: torch.einsum("thn,hnr->thr", q, wk),
        "bmm (transposed views)": lambda: torch.bmm(q.transpose(0, 1), wk).transpose(0, 1),
        "get_backend lookup": lambda: get_backend("rmsnorm", "triton"),
        "rmsnorm triton": lambda: rms(x, w, 1e-5),
        "rmsnorm triton + residual": lambda: rms(x, w, 1e-5, x),
    }
    out = {}
    for name, fn in cases.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(200):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        out[name] = statistics.median(ts)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="eager-step-host")
    ap.add_argument("--dense-layers", type=int, default=1)
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=1536)
    ap.add_argument("--mixed-prompt", type=int, default=1024)
    ap.add_argument("--mixed-decodes", type=int, default=63)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=4, help="steps per path and round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds over the paths (order reversed every round)")
    ap.add_argument("--paths", default="lookup,resolved", help=f"host paths to run, in this order: {list(PATHS)}")
    ap.add_argument("--profile-batch", type=int, default=64)
    ap.add_argument("--partial", default=None, help="write the results so far here after every case")
    args = ap.parse_args()
    device = torch.device("cuda")
    t_start = time.perf_counter()
    model, cfg = build_model(args.dense_layers, args.moe_layers, device)
    batches = [int(b) for b in args.batches.split(",") if b]
    plans = Plans(cfg.vocab_size)
    cases = [(f"decode {b}", plans.decode(b, args.context)) for b in batches]
    cases.append((f"mixed {args.mixed_prompt}+{args.mixed_decodes}",
                  [plans.prefill(0, args.mixed_prompt)] + plans.decode(args.mixed_decodes, args.context)))  # fmt: skip
    cases.append((f"prefill {args.prefill}", [plans.prefill(0, args.prefill)]))
    pool = random_pool(cfg, plans.next_page + 1, device)
    built = {name: build_forward_batch(build_plan(1, PAGE, reqs), device) for name, reqs in cases}
    torch.cuda.synchronize()
    print(f"model {args.dense_layers} dense + {args.moe_layers} MoE built with pool in "
          f"{time.perf_counter() - t_start:.1f} s", flush=True)  # fmt: skip
    paths = [p for p in args.paths.split(",") if p]
    rows, profiles, breakdown = [], {}, {}
    layers = args.dense_layers + args.moe_layers

    def dump():
        if args.partial:
            with open(args.partial, "w") as f:
                json.dump({"rows": rows, "profiles": profiles, "host_breakdown_ms": breakdown}, f, indent=1)

    prof_case = f"decode {args.profile_batch}"
    for batch in built.values():  # compile every case's kernels first: the first case timed is not the first run
        for path in paths:
            set_path(model, path)
            try:
                model(batch, pool)
            except Exception:  # noqa: BLE001, S110 - reported when the case is timed
                pass
    torch.cuda.synchronize()
    for name, batch in built.items():
        row = {"case": name, "tokens": batch.num_tokens}
        samples = {path: {} for path in paths}
        for rnd in range(args.rounds):  # paths interleaved, the order reversed every round: drift hits all alike
            for path in paths if rnd % 2 == 0 else paths[::-1]:
                if f"{path}_error" in row:
                    continue
                set_path(model, path)
                try:
                    time_case(model, pool, batch, args.iters, samples[path])
                except Exception as e:  # noqa: BLE001 - report and go on with the other cases
                    row[f"{path}_error"] = f"{type(e).__name__}: {e}"[:300]
                    print(name, path, row[f"{path}_error"], flush=True)
        for path in paths:
            if f"{path}_error" in row or not samples[path]:
                continue
            r = summarize(samples[path])
            for k, v in r.items():
                row[f"{path}_{k}"] = v
            row[f"{path}_enqueue_per_layer_ms"] = r["enqueue_ms"] / layers
            row[f"{path}_host/gpu"] = r["enqueue_ms"] / r["gpu_busy_ms"]
        for path in paths[1:]:  # the first path over each later one
            if f"{paths[0]}_wall_ms" in row and f"{path}_wall_ms" in row:
                row[f"enqueue_{paths[0]}/{path}"] = row[f"{paths[0]}_enqueue_ms"] / row[f"{path}_enqueue_ms"]
                row[f"wall_{paths[0]}/{path}"] = row[f"{paths[0]}_wall_ms"] / row[f"{path}_wall_ms"]
        print(row, flush=True)
        rows.append(row)
        if name == prof_case:  # the profile early: later cases may run out of time
            parts = {path: [] for path in paths}
            for rnd in range(2):
                for path in paths if rnd == 0 else paths[::-1]:
                    set_path(model, path)
                    spin = 4 * row.get(f"{path}_enqueue_ms", 50.0) + 20
                    parts[path].append(host_breakdown(model, pool, batch, spin, reps=3))
            for path, (b0, b1) in parts.items():
                breakdown[path] = {k: (b0[k] + b1[k]) / 2 for k in b0}
                print(f"host breakdown {path} (ms):", {k: round(v, 2) for k, v in breakdown[path].items()}, flush=True)
                set_path(model, path)
                profiles[path] = top_host_ops(model, pool, batch)
                print(f"profile {path}:", [(o["op"][:40], o["calls"], round(o["self_cpu_us"])) for o in profiles[path][:12]],
                      flush=True)  # fmt: skip
        dump()
    launch = launch_costs(device)
    ceilings = {"copy_TBps": copy_bandwidth() / 1e12, "bf16_TFLOPs": bf16_matmul_rate() / 1e12}
    cols = ["case", "tokens"]
    for path in paths:
        cols += [f"{path}_{c}" for c in ("enqueue_ms", "gpu_busy_ms", "wall_ms", "enqueue_per_layer_ms", "host_waits")]
    for path in paths[1:]:
        cols += [f"enqueue_{paths[0]}/{path}", f"wall_{paths[0]}/{path}"]
    cols += [f"{path}_host/gpu" for path in paths]
    notes = (
        f"GLM-5 layer shapes, {args.dense_layers} dense + {args.moe_layers} MoE layers, NVFP4 routed experts, "
        f"bf16 elsewhere, FP8 KV cache, kernels {CUDA_BACKENDS}; decode context {args.context}. "
        f"enqueue: the forward call's host time with the GPU idle at its start; gpu_busy: its device time "
        f"alone (events while a spin kernel holds the GPU until the step is queued); wall: back-to-back steps, "
        f"synchronised once; host_waits: the call took longer than half the spin (a device wait inside); "
        f"host/gpu > 1: the step is host-bound. Host paths: {paths} ({PATHS_DOC})."
    )
    stem = write_results(args.name, args.out, ceilings, rows, cols, notes)
    with open(stem + ".json") as f:
        data = json.load(f)
    data.update({"profiles": profiles, "host_breakdown_ms": breakdown, "launch_costs_us": launch, "machine": machine()})
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1)
    with open(stem + ".md", "a") as f:
        f.write("\n## Host microseconds per call, single ops (GPU idle)\n\n| op | us |\n|---|---|\n")
        for k, v in launch.items():
            f.write(f"| {k} | {v:.1f} |\n")
        if breakdown:
            kinds = list(next(iter(breakdown.values())))
            f.write(f"\n## Host ms per {prof_case} step by module kind (summed over layers; GPU held by a spin)\n\n")
            f.write("| path | " + " | ".join(kinds) + " |\n|---|" + "---|" * len(kinds) + "\n")
            for path, b in breakdown.items():
                f.write(f"| {path} | " + " | ".join(f"{b.get(k, 0.0):.2f}" for k in kinds) + " |\n")
        for path, ops in profiles.items():
            f.write(f"\n## torch.profiler, one {prof_case} step, path {path}: top host ops by self CPU time\n\n")
            f.write("| op | calls | self_cpu_us | cpu_total_us | device_us |\n|---|---|---|---|---|\n")
            for o in ops:
                f.write(f"| {o['op'][:60]} | {o['calls']} | {o['self_cpu_us']:.0f} | {o['cpu_total_us']:.0f} | "
                        f"{o['device_us']:.0f} |\n")  # fmt: skip
    print(notes)
    print(f"results: {stem}.{{json,md}}")
    print_table(rows, cols)
    print("launch costs (us):", {k: round(v, 1) for k, v in launch.items()})
    print(f"total {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
