"""Memory roofline of one decode step of a GLM-5-shaped checkpoint, and the copy bandwidth it is
divided by (measured in the same run).

A decode step of B requests must read at least:
  - every weight each token passes through once: attention and indexer projections, dense MLPs,
    shared experts, routers, norms, lm_head (all layers), plus B embedding rows;
  - per MoE layer, the routed experts that at least one of the B tokens chose: with uniform
    routing of k of E experts per token that is E * (1 - (1 - k/E)^B) experts in expectation;
  - per layer, the KV the step touches: `sel` latent rows for sparse attention (each request's
    min(context, index_topk) selected tokens) and `idx` indexer keys (the indexer scores every
    cached token, unless no context of the step exceeds index_topk: then it selects whole
    contexts without reading them, and idx is 0), in the cache's storage format.
Activations, the KV written for the new token and the sampler are left out (each is under 1% of
the weights at GLM-5 shapes), so the bound is a slight underestimate: steps can only be slower.

Under tensor parallelism (tp > 1) the bound is one rank's, divided by one GPU's bandwidth: the
tensors model/parallel.py splits (attention q_b/kv_b/o_proj heads, dense MLPs, shared experts,
lm_head) count 1/tp, routed experts count the rank's E/tp share of the distinct ones, and the
rest (q_a/kv_a, the indexer, routers, norms) and the whole KV (the latent and index caches are
replicated) count in full. The all-reduces between ranks are not in it.

With data-parallel attention (dp_attention) each rank holds the whole attention (every self_attn
tensor counts in full) and reads only its own requests' KV (the step's KV over tp, the requests
spread evenly); MLPs, experts and lm_head split as above.

Tensor sizes come from the safetensors headers, or, for a directory holding only a config (the
weights drawn at load, `--load-format random`), from the generator's tensor list.

Beside it, a bound that also counts the tensor cores (step_bound): the same step split in three
parts run one after the other (the weights' matmuls, the routed experts, the attention over the
KV), each taking at least the longer of its bytes over the copy bandwidth and its multiply-adds
over the bf16 matmul rate (measured in the same run). At 256 rows a bf16 weight is used for 512
FLOP per 2 bytes it takes to read, past the H200's ~190 FLOP/byte (796 TFLOP/s over 4.27 TB/s):
the dense matmuls are compute-bound there, which the memory roofline does not count. The issue's
target is judged on the memory roofline; the bound says how far a step is from what the card can
do at all.
"""

from __future__ import annotations

import json
import os
import re
import time

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def _tensor_sizes(model_path: str) -> dict[str, tuple[int, list[int], str]]:
    """name -> (bytes, shape, safetensors dtype), from the headers only (no tensor data is read)."""
    import struct

    sizes = {}
    for name in sorted(os.listdir(model_path)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(model_path, name), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for key, meta in header.items():
            if key != "__metadata__":
                begin, end = meta["data_offsets"]
                sizes[key] = (end - begin, list(meta["shape"]), meta["dtype"])
    return sizes


# Split across tensor-parallel ranks (model/parallel.py); every other tensor is replicated.
_SHARDED = re.compile(
    r"(self_attn\.(q_b_proj|kv_b_proj|o_proj)\.|mlp\.(gate_proj|up_proj|down_proj)\.|shared_experts\.|^lm_head\.)"
)


def _generated_sizes(cfg: dict) -> dict[str, tuple[int, list[int], str]]:
    """name -> (bytes, shape, dtype) of the tensors the GLM-5-shaped generator draws for this config (NVFP4
    routed experts: packed e2m1 codes, an e4m3 scale per 16, a float32 global scale; bf16 else)."""
    from nsaserve.kernels.quant.make_glm5_shaped import dense_tensor_shapes

    sizes = {}
    for name, shape, kind in dense_tensor_shapes(cfg):
        n = 1
        for d in shape:
            n *= d
        sizes[name] = (n * 4, list(shape), "F32") if kind == "bias" else (n * 2, list(shape), "BF16")
    H, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    for i, kind in enumerate(cfg["mlp_layer_types"][: cfg["num_hidden_layers"]]):
        if kind != "sparse":
            continue
        for e in range(cfg["n_routed_experts"]):
            for part in ("gate_proj", "up_proj", "down_proj"):
                p = f"model.layers.{i}.mlp.experts.{e}.{part}."
                sizes[p + "weight"] = (H * inter // 2, [inter, H // 2], "U8")
                sizes[p + "weight_scale"] = (H * inter // 16, [inter, H // 16], "F8_E4M3")
                sizes[p + "weight_scale_2"] = (4, [], "F32")
    return sizes


class DecodeRoofline:
    """Bytes a decode step must read on one rank, from a checkpoint's tensors (or its generator's)
    and config."""

    def __init__(self, model_path: str, kv_cache_dtype: str = "fp8_e4m3", tp: int = 1, dp_attention: bool = False):
        with open(os.path.join(model_path, "config.json")) as f:
            cfg = json.load(f)
        self.tp = tp
        self.kv_share = 1 / tp if dp_attention else 1.0
        self.layers = int(cfg["num_hidden_layers"])
        self.experts = int(cfg["n_routed_experts"])
        self.top_k = int(cfg["num_experts_per_tok"])
        self.hidden = int(cfg["hidden_size"])
        self.vocab = int(cfg["vocab_size"])
        self.moe_layers = sum(t == "sparse" for t in cfg["mlp_layer_types"][: self.layers])
        fixed = expert_bytes = matmul = 0
        sizes = _tensor_sizes(model_path) or _generated_sizes(cfg)
        for name, (size, shape, dtype) in sizes.items():
            m = re.match(r"^model\.layers\.(\d+)\.", name)
            if (m and int(m.group(1)) >= self.layers) or name.endswith(".input_scale"):
                continue  # layers past the served depth; W4A4-only activation scales
            if name == "model.embed_tokens.weight":
                continue  # only B rows are read: counted per step
            if _EXPERT.match(name):
                expert_bytes += size
            else:
                split = _SHARDED.search(name) and not (dp_attention and ".self_attn." in name)
                fixed += size / tp if split else size
                if len(shape) == 2 and "scale" not in name:  # a matrix each token multiplies (not norms)
                    packed = 2 if dtype == "U8" else 1  # NVFP4 codes: two weights a byte
                    matmul += shape[0] * shape[1] * packed / (tp if split else 1)
        self.fixed_bytes = fixed
        # Weight elements a token multiplies on this rank (the absorbed MLA's per-head products use
        # kv_b_proj's elements once each, as the plain projection would).
        self.matmul_elements = matmul
        self.heads = int(cfg["num_attention_heads"])
        self.moe_inter = int(cfg["moe_intermediate_size"])
        self.index_heads = int(cfg.get("index_n_heads", 0))
        # Average bytes of one routed expert (all experts of all MoE layers have the same shapes).
        self.expert_bytes = expert_bytes / max(1, self.moe_layers * self.experts)
        r, p, d = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"]), int(cfg["index_head_dim"])
        if kv_cache_dtype == "fp8_e4m3":
            group = min(128, r)
            self.latent_row = r + 4 * (r // group) + 2 * p  # FlashMLA's 656-byte row at GLM-5 dims
            self.index_row = d + 4  # e4m3 key + float32 scale
        else:
            self.latent_row, self.index_row = 2 * (r + p), 2 * d
        n_full = sum(t == "full" for t in cfg.get("indexer_types", ["full"] * self.layers)[: self.layers])
        self.index_layers = n_full
        self.rank, self.rope, self.index_dim = r, p, d

    def distinct_experts(self, batch: int) -> float:
        return self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** batch)

    def step_bytes(self, batch: int, ctx: int, sel: int) -> dict[str, float]:
        """Bytes of one decode step of `batch` requests whose indexer scores `ctx` cached tokens in
        all and whose selected tokens sum to `sel`; split by what they are."""
        weights = self.fixed_bytes + 2 * batch * self.hidden
        experts = self.moe_layers * self.distinct_experts(batch) * self.expert_bytes / self.tp
        kv = (self.layers * sel * self.latent_row + self.index_layers * ctx * self.index_row) * self.kv_share
        return {"weights": weights, "experts": experts, "kv": kv, "total": weights + experts + kv}

    def step_flops(self, batch: int, ctx: int, sel: int) -> dict[str, float]:
        """Multiply-add FLOPs of the same step on this rank: every weight matrix once per token, each
        token's top-k experts (gate, up and down), and per layer the sparse attention over the
        selected latent rows (scores over rank + rope dims, the output over rank) and the indexer's
        logits over the scored keys. Under tensor parallelism a rank has 1/tp of the heads (with
        data-parallel attention all heads and 1/tp of the requests: the same share) and of the
        routed slots; the indexer is replicated unless attention is data parallel."""
        weights = 2 * batch * self.matmul_elements
        experts = self.moe_layers * batch * self.top_k * 2 * 3 * self.hidden * self.moe_inter / self.tp
        mla = self.layers * 2 * self.heads * sel * (2 * self.rank + self.rope) / self.tp
        index = self.index_layers * 2 * self.index_heads * ctx * self.index_dim * self.kv_share
        attention = mla + index
        return {"weights": weights, "experts": experts, "attention": attention, "total": weights + experts + attention}

    def step_bound_s(self, batch: int, ctx: int, sel: int, bandwidth: float, matmul_rate: float) -> dict[str, float]:
        """Seconds the step needs at least, by part: each part's bytes over the bandwidth or its FLOPs
        over the matmul rate, whichever is longer (parts run one after another; inside a part reads
        and tensor-core work overlap)."""
        b, f = self.step_bytes(batch, ctx, sel), self.step_flops(batch, ctx, sel)
        parts = {
            "weights": max(b["weights"] / bandwidth, f["weights"] / matmul_rate),
            "experts": max(b["experts"] / bandwidth, f["experts"] / matmul_rate),
            "attention": max(b["kv"] / bandwidth, f["attention"] / matmul_rate),
        }
        return {**parts, "total": sum(parts.values())}


def measure_copy_bandwidth(device: str = "cuda", nbytes: int = 4 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda *_: None)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    seconds = time.perf_counter() - t0
    del src, dst
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes * iters / seconds


def measure_matmul_rate(device: str = "cuda", n: int = 8192, iters: int = 10) -> float:
    """bf16 matmul FLOP/s of an n x n x n product on random data (the tensor cores' ceiling)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda *_: None)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    seconds = time.perf_counter() - t0
    del a, b
    return 2 * n**3 * iters / seconds


def median(xs):
    """The middle value (the upper one of an even count), or None for no values."""
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def decode_step_report(
    steps: list[dict], roofline: DecodeRoofline, bandwidth: float, level: int, matmul_rate: float | None = None
) -> dict:
    """Decode-only steps of one load level (lines of the worker's step log) against their rooflines.

    `full` are the steps running at least 90% of the level's concurrency (the steady state the
    level is named after); medians are over those when there are any, else over all decode steps.
    With matmul_rate (FLOP/s), also against step_bound (memory or tensor cores, part by part)."""
    decode = [s for s in steps if s["mode"] == "decode"]
    if not decode:
        return {"decode_steps": 0}
    full = [s for s in decode if s["reqs"] >= 0.9 * level]
    use = full or decode
    rows = []
    for s in use:
        shape = (s["reqs"], s.get("idx", s["ctx"]), s["sel"])  # (batch, scored keys, selected rows); old logs: ctx
        b = roofline.step_bytes(*shape)
        rows.append((s["ms"], 1e3 * b["total"] / bandwidth, b, s, shape))
    ms = median([r[0] for r in rows])
    roof = median([r[1] for r in rows])
    mid = sorted(rows, key=lambda r: r[1])[len(rows) // 2]
    mixed = [s for s in steps if s["mode"] != "decode"]
    bound = {}
    if matmul_rate:
        bound_ms = [1e3 * roofline.step_bound_s(*r[4], bandwidth, matmul_rate)["total"] for r in rows]
        at_mid = roofline.step_bound_s(*mid[4], bandwidth, matmul_rate)
        bound = {
            "bound_ms_median": median(bound_ms),
            "ratio_to_bound_median": median([r[0] / t for r, t in zip(rows, bound_ms)]),
            "bound_at_median_ms": {k: round(1e3 * v, 3) for k, v in at_mid.items()},
            "tflop_at_median": {k: round(v / 1e12, 3) for k, v in roofline.step_flops(*mid[4]).items()},
        }
    # Worker time between steps (receive, validate, fill references, build the batch is inside
    # "ms"; this is what is outside it): end-to-end spacing of consecutive steps minus the step.
    gaps = [1e3 * (b["t"] - a["t"]) - b["ms"] for a, b in zip(steps, steps[1:]) if "t" in a and "t" in b]
    return {
        "between_steps_ms_median": median(gaps),
        "decode_steps": len(decode),
        "full_steps": len(full),
        "graph_steps": sum(bool(s.get("graph")) for s in use),
        "prefill_or_mixed_steps": len(mixed),
        "prefill_or_mixed_ms_median": median([s["ms"] for s in mixed]),
        "prefill_or_mixed_tokens_median": median([s["tokens"] for s in mixed]),
        "batch_median": median([r[3]["reqs"] for r in rows]),
        "context_median": median([r[3]["ctx"] / r[3]["reqs"] for r in rows]),
        "step_ms_median": ms,
        "roofline_ms_median": roof,
        "ratio_median": median([r[0] / r[1] for r in rows]),
        "bytes_at_median_gb": {k: round(v / 1e9, 3) for k, v in mid[2].items()},
        **bound,
        # The device's own timeline (step logs on CUDA, worker/step_log.py): the step's work,
        # the uploads queued ahead of it, and the device's idle time before it.
        **{f"{k}_median": median([s[k] for s in use if k in s]) for k in ("gpu_ms", "prep_ms", "gap_ms")},
        "prompt_steps": prompt_step_report(mixed),
    }


def slow_steps(steps: list[dict], limit_ms: float = 1000.0, keep: int = 20) -> dict:
    """Steps of a whole run (the worker's step log) that took over limit_ms. At GLM-5 shapes on one
    H200 a step of ~16K prompt tokens takes ~330 ms, so a step past a second is one that waited
    for something else: a kernel variant compiled while serving (a 6 s stall seen on 2026-12-02;
    the step log's "compiles" says so, worker/compile_watch.py), or the allocator flushing its cache."""
    slow = [s for s in steps if s["ms"] > limit_ms]
    fields = ("step", "mode", "reqs", "tokens", "ctx", "ms", "gpu_ms", "host_launch_ms", "mallocs", "retries", "compiles", "compile_s")
    compiled = [s for s in steps if s.get("compiles")]
    return {"limit_ms": limit_ms, "count": len(slow), "first": [{k: s[k] for k in fields if k in s} for s in slow[:keep]],
            "steps_that_compiled": len(compiled), "compile_s": round(sum(s.get("compile_s", 0.0) for s in compiled), 3)}  # fmt: skip


def _step_ms(s: dict) -> float:
    """A step's time: its device work (gpu_ms) where the log has it, else its wall time. With the
    worker pipeline a step's wall time is not its own (a prompt step of ~330 ms of device work
    logged 0.6 ms, the next one 676 ms: the host waited for both in the second)."""
    return s["gpu_ms"] if s.get("gpu_ms") is not None else s["ms"]


def decode_path_split(steps: list[dict]) -> dict:
    """A phase's decode steps by path: replayed CUDA graphs or eager. Contexts past the graphs'
    largest context bucket (--cuda-graph-max-context) or batches past the largest graph decode
    eagerly, at a different speed; this says how many did. Times: device work where logged."""
    out = {}
    for path, graph in (("graph", True), ("eager", False)):
        sel = [s for s in steps if s.get("mode") == "decode" and bool(s.get("graph")) == graph]
        out[path] = {"steps": len(sel), "ms_median": median([_step_ms(s) for s in sel]),
                     "reqs_median": median([s["reqs"] for s in sel])}  # fmt: skip
    return out


def prompt_step_report(mixed: list[dict]) -> dict:
    """The level's prefill and mixed steps, split by what the step log says about them: dense or
    sparse attention, and whether the caching allocator had to allocate device memory (or flush
    its cache and retry) during the step. A mean well above the median with few slow steps points
    at one-off costs; the split says whether they come with allocations. Times are device work
    where the log has it ("time": "gpu_ms"), else wall time. Lines of older step logs (without
    those fields) count as sparse, allocation-free steps."""

    def stats(rows):
        ms = sorted(_step_ms(s) for s in rows)
        if not ms:
            return {"steps": 0}
        return {"steps": len(ms), "ms_median": ms[len(ms) // 2], "ms_mean": round(sum(ms) / len(ms), 3),
                "ms_max": ms[-1], "tokens_total": sum(s["tokens"] for s in rows)}  # fmt: skip

    def allocates(s) -> bool:
        return bool(s.get("mallocs", 0) or s.get("retries", 0))

    return {
        "time": "gpu_ms" if mixed and all(s.get("gpu_ms") is not None for s in mixed) else "ms",
        "all": stats(mixed),
        "dense": stats([s for s in mixed if s.get("dense")]),
        "sparse": stats([s for s in mixed if not s.get("dense")]),
        "with_device_allocations": stats([s for s in mixed if allocates(s)]),
        "without_device_allocations": stats([s for s in mixed if not allocates(s)]),
        "allocator_retries": sum(s.get("retries", 0) for s in mixed),
    }
