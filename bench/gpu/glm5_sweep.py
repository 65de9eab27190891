"""End-to-end sweep of a GLM-5-shaped NVFP4 checkpoint on one GPU, inside a time budget.

Phases (each skipped, and said so, when the budget cannot cover it):
  bandwidth  device copy bandwidth (the roofline's divisor, measured in this run) and the bf16
             matmul rate (the tensor cores' ceiling, for the bound that counts them too)
  generate   the checkpoint (kernels/quant/make_glm5_shaped.py on the GPU), reused when present
  serve      `nsaserve serve --kv-cache-dtype fp8_e4m3` (radix cache on), worker step log on
  prefill    single requests alone (max_tokens 1): the TTFT target's reference
  sweep      `nsaserve bench` random I/O at each concurrency level; per level the decode steps'
             time (worker step log) against their memory roofline (glm5_roofline.py)
  shared     `nsaserve bench --dataset-name shared-prefix` (prefix hit rate from /metrics)
  compare    the same weights cut to --compare-moe-layers MoE layers, served by us and run by
             transformers' model.generate on the same prompts: our output tok/s / theirs

Writes OUT/results.json and appends to OUT/log.txt; prints a summary table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from glm5_roofline import (  # noqa: E402
    DecodeRoofline,
    decode_path_split,
    decode_step_report,
    measure_copy_bandwidth,
    measure_matmul_rate,
    slow_steps,
)
from glm5_serving import Server, finite_logits_check, gpu_memory, random_flags  # noqa: E402
from glm5_summary import summary_table, targets  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for results.json and log.txt")
    p.add_argument("--budget-s", type=float, default=530, help="wall-clock budget for everything")
    p.add_argument("--phases", default="sweep,shared,compare", help="comma-separated, run in this order "
                   "(sweep and shared share one server)")  # fmt: skip
    p.add_argument("--model-path", default=None, help="checkpoint directory (generated there when absent); default: "
                   "/dev/shm/glm5-shaped-<N>moe when /dev/shm has room, else $TMPDIR")  # fmt: skip
    p.add_argument("--moe-layers", type=int, default=6, help="MoE layers after the 3 dense ones")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a functional check only")
    p.add_argument("--tiny", action="store_true", help="generate the generator's tiny scale-down")
    p.add_argument("--gen-set", action="append", default=[], help="config override for the generator, key=json")
    p.add_argument("--keep-model", action="store_true", help="keep a generated checkpoint for a later call")
    p.add_argument("--random-weights", action="store_true", help="write only the config and tokenizer and serve "
                   "with --load-format random: every rank draws its weights on its GPU at load (the generator's "
                   "tensors, nothing on disk); for depths whose checkpoint would not fit the disk or the time")  # fmt: skip
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (GPUs) of the server")
    # serving
    p.add_argument("--attention-backend", default="", help="passed to serve when set")
    p.add_argument("--indexer-backend", default="", help="passed to serve when set")
    p.add_argument("--moe-backend", default="", help="passed to serve when set")
    p.add_argument("--serve-arg", action="append", default=[], help="extra serve flag (repeatable)")
    p.add_argument("--ready-timeout-s", type=float, default=None, help="give up on a server start after this "
                   "long (with --tp > 1 and graphs on, the sweep then starts one without CUDA graphs)")  # fmt: skip
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    # load
    p.add_argument("--levels", default="64,256,512,1024")
    p.add_argument("--waves", type=float, default=1.0, help="prompts per level = waves x concurrency")
    p.add_argument("--level-waves", default="", help="per-level waves, e.g. 64:4,256:2 (others: --waves); "
                   "with more waves than one, most requests arrive into a running batch, as in steady serving")
    p.add_argument("--warmup-prompts", type=int, default=0, help="before the levels: this many requests at "
                   "the first level's concurrency (input as the levels, 16 tokens out), not reported: "
                   "the server's own warm-up compiles the kernels before it is ready; this settles the rest")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--range-ratio", type=float, default=0.8)
    p.add_argument("--prefill-probes", type=int, default=3, help="single requests timed alone (0: none)")
    p.add_argument("--shared-conversations", type=int, default=64)
    p.add_argument("--shared-concurrency", type=int, default=64)
    p.add_argument("--shared-system-len", type=int, default=2048)
    p.add_argument("--shared-question-len", type=int, default=128)
    p.add_argument("--shared-output-len", type=int, default=64)
    p.add_argument("--shared-turns", type=int, default=2)
    # transformers side by side
    p.add_argument("--compare-moe-layers", type=int, default=1)
    p.add_argument("--compare-batch", type=int, default=32)
    p.add_argument("--compare-input-len", type=int, default=1024)
    p.add_argument("--compare-output-len", type=int, default=64)
    p.add_argument("--compare-repeats", type=int, default=1, help="bench runs per server of ours; the median "
                   "output tok/s is compared (repeats after the first draw new prompts of the same lengths: the "
                   "same ones would hit the radix cache)")
    p.add_argument("--compare-variant", action="append", default=[], help="serve flags (one string, split like a "
                   "shell) for a further server of ours in the compare phase, measured the same way against the "
                   "same transformers run, e.g. --compare-variant=--disable-worker-pipeline (repeatable)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--request-body", default="", help="JSON object merged into every benchmark request, e.g. "
                   "'{\"temperature\": 1.0, \"top_p\": 0.95}' (default: greedy requests)")
    return p.parse_args(argv)


class Run:
    """Log, deadline and the results document."""

    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="glm5-sweep-"))
        self.bench_calls = 0
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget_s
        self.log_file = open(self.out / "log.txt", "a", buffering=1)
        self.doc = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
            "params": vars(args),
            "phases": {},
            "skipped": [],
        }

    def say(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.doc, indent=2) + "\n")


def default_model_path(moe_layers: int, need_bytes: int) -> str:
    name = f"glm5-shaped-{moe_layers}moe"
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need_bytes * 1.15 + (8 << 30):
        return f"/dev/shm/{name}"
    return os.path.join(tempfile.gettempdir(), name)


def generator_overrides(items: list[str]) -> dict:
    return {k: json.loads(v) for k, _, v in (i.partition("=") for i in items)}


def ensure_checkpoint(run: Run) -> str:
    from nsaserve.kernels.quant.make_glm5_shaped import checkpoint_bytes_estimate, glm5_config

    a = run.args
    from nsaserve.kernels.quant.make_glm5_shaped import TINY_OVERRIDES

    overrides = (dict(TINY_OVERRIDES) if a.tiny else {}) | generator_overrides(a.gen_set)
    need = checkpoint_bytes_estimate(glm5_config(a.moe_layers, 3, overrides))
    if a.random_weights:
        name = f"glm5-shaped-{a.moe_layers}moe-config"
        path = a.model_path or os.path.join(tempfile.gettempdir(), name)
    else:
        path = a.model_path or default_model_path(a.moe_layers, need)
    info = {"path": path, "estimated_gb": round(need / 1e9, 2), "random_weights": a.random_weights}
    has_weights = any(n.endswith(".safetensors") for n in os.listdir(path)) if os.path.isdir(path) else False
    complete = os.path.exists(os.path.join(path, "config.json")) and os.path.exists(os.path.join(path, "tokenizer.json"))
    if complete and has_weights == (not a.random_weights):
        run.say(f"reusing checkpoint {path}")
        info["reused"] = True
    else:
        shutil.rmtree(path, ignore_errors=True)
        usage = shutil.disk_usage(os.path.dirname(path))
        what = "the config (weights drawn at load)" if a.random_weights else f"{need / 1e9:.1f} GB"
        run.say(f"generating {what} at {path} ({usage.free / 1e9:.0f} GB free there)")
        cmd = [sys.executable, "-m", "nsaserve.kernels.quant.make_glm5_shaped", "--dst", path,
               "--moe-layers", str(a.moe_layers), "--device", a.device]  # fmt: skip
        if a.random_weights:
            cmd.append("--config-only")
        if a.tiny:
            cmd.append("--tiny")
        for item in a.gen_set:
            cmd += ["--set", item]
        t = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10, run.left()))
        run.log_file.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        if proc.returncode != 0:
            raise RuntimeError(f"generation failed: {proc.stderr[-2000:]}")
        info["generate_s"] = round(time.monotonic() - t, 1)
        run.say(f"generated in {info['generate_s']} s")
    info["disk_free_gb"] = round(shutil.disk_usage(path).free / 1e9, 1)
    # What is actually there (a reused checkpoint may differ from the flags).
    with open(os.path.join(path, "config.json")) as f:
        types = json.load(f)["mlp_layer_types"]
    info["dense_layers"], info["moe_layers"] = types.count("dense"), types.count("sparse")
    files = [os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors")]
    info["size_gb"] = round(sum(os.path.getsize(f) for f in files) / 1e9, 2)
    run.doc["checkpoint"] = info
    return path


def start_server(run: Run, model_path: str, tag: str, max_running: int, extra: list[str] = ()) -> Server:
    a = run.args
    flags = ["--device", a.device, "--kv-cache-dtype", a.kv_cache_dtype, "--max-running-requests", str(max_running)]
    if a.tp > 1:
        flags += ["--tp", str(a.tp)]
    if a.random_weights:
        flags += ["--load-format", "random"]
    for flag, value in (("--attention-backend", a.attention_backend), ("--indexer-backend", a.indexer_backend),
                        ("--moe-backend", a.moe_backend)):  # fmt: skip
        if value:
            flags += [flag, value]
    return Server(model_path, run.work, tag, flags + a.serve_arg + list(extra), run.log_file, run.left)


def bench(run: Run, server: Server, name: str, flags: list[str], model_path: str, seed: int | None = None) -> dict | None:
    """One `nsaserve bench` run; its JSON document, or None if it did not finish in the budget.

    Each call draws its prompts with its own seed (--seed + 1000 x the call's number) unless one
    is given: one server serves every level, and a level that repeated an earlier call's prompts
    would find them in the radix cache (its prefill nearly free, its throughput and TTFT not those
    of new prompts). The prefix hit rate of every run is in its results to show that they do not."""
    out = run.work / f"bench-{name}.json"
    run.bench_calls += 1
    seed = run.args.seed + 1000 * run.bench_calls if seed is None else seed
    cmd = [sys.executable, "-m", "nsaserve", "bench", "--port", str(server.port), "--tokenizer", model_path,
           "--disable-tqdm", "--warmup-requests", "0", "--seed", str(seed), "--output-file", str(out), *flags]  # fmt: skip
    if run.args.request_body:
        cmd += ["--extra-request-body", run.args.request_body]
    timeout = run.left() - 45  # keep time to stop the server and write results
    if timeout < 10:
        run.doc["skipped"].append(f"bench {name}: no time left")
        run.say(f"skip bench {name}: {run.left():.0f} s left")
        return None
    run.say(f"bench {name}: {' '.join(flags)} (timeout {timeout:.0f} s)")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        run.doc["skipped"].append(f"bench {name}: did not finish within {timeout:.0f} s")
        run.say(f"bench {name}: timed out")
        return None
    run.log_file.write(proc.stdout[-3000:] + proc.stderr[-2000:])
    if proc.returncode != 0 or not out.exists():
        run.say(f"bench {name}: exit {proc.returncode}: {proc.stderr[-500:]}")
        return None
    doc = json.loads(out.read_text())
    s = doc["runs"][0]["summary"]
    run.say(f"bench {name}: {s['completed']} ok, {s['failed']} failed, out {s['output_throughput']:.1f} tok/s, "
            f"total {s['total_throughput']:.1f} tok/s, TTFT p50 {s['ttft']['p50_ms']} ms, TPOT p50 {s['tpot']['p50_ms']} ms")  # fmt: skip
    return doc


def phase_serving(run: Run, model_path: str, roofline: DecodeRoofline, bandwidth: float, phases: list[str],
                  matmul_rate: float | None = None) -> None:  # fmt: skip
    a = run.args
    levels = [int(x) for x in a.levels.split(",") if x]
    max_running = max(levels + [a.shared_concurrency, 1])
    server = start_server(run, model_path, "main", max_running)
    run.doc["serve_command"] = server.command
    try:
        try:
            ready = server.wait_ready(a.ready_timeout_s)
        except (RuntimeError, TimeoutError) as e:
            # Graph capture is the newest part of a tensor-parallel start: rather than lose the
            # run, say what failed and measure the eager server.
            if a.tp == 1 or "--disable-cuda-graph" in a.serve_arg:
                raise
            run.say(f"server failed to start with CUDA graphs; again without: {str(e)[-1500:]}")
            run.doc["graphs_failed"] = str(e)[-3000:]
            server.stop()
            a.serve_arg.append("--disable-cuda-graph")
            server = start_server(run, model_path, "main-eager", max_running)
            run.doc["serve_command"] = server.command
            ready = server.wait_ready(a.ready_timeout_s)
        ready_line = next(x for x in server.log_path.read_text().splitlines() if "nsaserve ready" in x)
        run.say(f"server ready in {ready:.1f} s: {ready_line}")
        run.doc["phases"]["serve"] = {"ready_s": round(ready, 1), "ready_line": ready_line, "gpu_memory": gpu_memory(),
                                      "cuda_graphs": server.log_lines("CUDA graphs")}  # fmt: skip
        for line in run.doc["phases"]["serve"]["cuda_graphs"]:
            run.say(line)
        try:
            check = finite_logits_check(server.port, roofline.vocab)
        except Exception as e:  # a NaN the server cannot even serialise shows up here
            check = {"finite": False, "error": f"{type(e).__name__}: {e}"}
        run.doc["phases"]["finite_logits"] = check
        run.say(f"finite logits check: {check}")
        probe = None
        if a.prefill_probes > 0:
            # One extra request first (--warmup-requests 1) so the probes see a warm server.
            flags = random_flags(1, a.prefill_probes, a.input_len, 1, 1.0) + ["--warmup-requests", "1"]
            probe = bench(run, server, "prefill-alone", flags, model_path)
        if probe:
            s = probe["runs"][0]["summary"]
            run.doc["phases"]["prefill_alone"] = {
                "ttft_p50_ms": s["ttft"]["p50_ms"],
                "ttft_ms": s["ttft"],
                "input_len": a.input_len,
            }
        if "sweep" in phases:
            sweep = run.doc["phases"].setdefault("sweep", [])
            waves = {int(k): float(v) for k, _, v in (x.partition(":") for x in a.level_waves.split(",") if x)}
            if a.warmup_prompts > 0:
                flags = random_flags(levels[0], a.warmup_prompts, a.input_len, 16, a.range_ratio)
                if bench(run, server, "warmup", flags, model_path) is not None:
                    run.doc["phases"]["warmup"] = {"prompts": a.warmup_prompts, "concurrency": levels[0]}
            for level in levels:
                n_before = len(server.steps())
                prompts = max(1, int(round(waves.get(level, a.waves) * level)))
                doc = bench(run, server, f"random-{level}",
                            random_flags(level, prompts, a.input_len, a.output_len, a.range_ratio), model_path)  # fmt: skip
                if doc is None:
                    break
                steps = server.steps()[n_before:]
                entry = {"concurrency": level, "num_prompts": prompts, "bench": doc["runs"][0],
                         "decode": decode_step_report(steps, roofline, bandwidth, level, matmul_rate),
                         "step_modes": {m: sum(s["mode"] == m for s in steps) for m in ("prefill", "decode", "mixed")}}  # fmt: skip
                sweep.append(entry)
                run.save()
                d = entry["decode"]
                if d.get("decode_steps"):
                    run.say(f"level {level}: decode step {d['step_ms_median']:.1f} ms at batch {d['batch_median']} "
                            f"vs roofline {d['roofline_ms_median']:.2f} ms ({d['ratio_median']:.2f}x), "
                            + (f"vs bound {d['bound_ms_median']:.2f} ms ({d['ratio_to_bound_median']:.2f}x), "
                               if d.get("bound_ms_median") else "")
                            + f"{d['graph_steps']} of {d['full_steps'] or d['decode_steps']} replayed graphs; "
                            f"{d['prefill_or_mixed_steps']} prefill/mixed steps, median {d['prefill_or_mixed_ms_median']} ms "
                            f"for {d['prefill_or_mixed_tokens_median']} tokens; {d['between_steps_ms_median']} ms between steps; "
                            f"device: {d.get('gpu_ms_median')} ms of work, {d.get('gap_ms_median')} ms idle before it")  # fmt: skip
                    ps = d["prompt_steps"]
                    run.say(f"level {level} prompt steps ({ps['time']} mean / median / max): "
                            + "; ".join(f"{k} {v['steps']}" + (f" ({v['ms_mean']} / {v['ms_median']} / {v['ms_max']})" if v["steps"] else "")
                                        for k, v in ps.items() if isinstance(v, dict))
                            + f"; allocator retries {ps['allocator_retries']}")  # fmt: skip
        if "shared" in phases:
            flags = ["--dataset-name", "shared-prefix", "--num-prompts", str(a.shared_conversations),
                     "--max-concurrency", str(a.shared_concurrency), "--gsp-system-prompt-len", str(a.shared_system_len),
                     "--gsp-question-len", str(a.shared_question_len), "--gsp-output-len", str(a.shared_output_len),
                     "--gsp-num-turns", str(a.shared_turns)]  # fmt: skip
            n_before = len(server.steps())
            doc = bench(run, server, "shared-prefix", flags, model_path)
            if doc:
                run.doc["phases"]["shared_prefix"] = doc["runs"][0]
                split = run.doc["phases"]["shared_prefix_decode"] = decode_path_split(server.steps()[n_before:])
                run.say("shared prefix decode steps: " + ", ".join(
                    f"{p} {v['steps']} (median {v['ms_median']} ms, {v['reqs_median']} requests)" for p, v in split.items()
                ))  # fmt: skip
        slow = run.doc["slow_steps"] = slow_steps(server.steps())
        run.say(f"steps over {slow['limit_ms']:.0f} ms in the whole run: {slow['count']}"
                + "".join(f"; step {s['step']} ({s['mode']}, {s['tokens']} tokens) {s['ms']} ms" for s in slow["first"][:5]))  # fmt: skip
        # Kernel variants the worker compiled after its warm-up (worker/compile_watch.py): each
        # stalled a step; the answer wanted is none.
        compiled = run.doc["compiled_while_serving"] = server.log_lines("while serving")
        run.say(f"kernel variants compiled while serving: {len(compiled)}" + "".join(f"\n  {x}" for x in compiled[:10]))
    finally:
        server.stop()


def compare_prompts(a, vocab: int) -> list[list[int]]:
    """The prompts `nsaserve bench` sends for the compare run (same seed, level 0, same flags)."""
    from nsaserve.bench.datasets import random_dataset
    from nsaserve.bench.main import DATASET, rng_for

    ns = argparse.Namespace(seed=a.seed)
    convs = random_dataset(
        rng_for(ns, 0, DATASET), a.compare_batch, a.compare_input_len, a.compare_output_len, 1.0, vocab
    )
    return [c.turns[0].prompt for c in convs]


def phase_compare(run: Run, model_path: str) -> None:
    import torch

    a = run.args
    if a.random_weights or a.tp > 1:
        run.doc["skipped"].append("compare: transformers runs one GPU from a checkpoint on disk")
        return
    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    dense = cfg["mlp_layer_types"].count("dense")
    layers = dense + a.compare_moe_layers
    from glm5_transformers import generate_throughput, load_transformers_model, truncated_view

    view = truncated_view(model_path, str(run.work / f"view-{layers}"), layers)
    entry = run.doc["phases"].setdefault("compare", {"layers": layers, "moe_layers": a.compare_moe_layers,
                                                     "batch": a.compare_batch, "input_len": a.compare_input_len,
                                                     "output_len": a.compare_output_len})  # fmt: skip
    flags = random_flags(a.compare_batch, a.compare_batch, a.compare_input_len, a.compare_output_len, 1.0)
    # A full batch of warm-up requests first, not measured: first-use kernel compilation at these
    # shapes (transformers gets a warm-up generate too).
    flags += ["--warmup-requests", str(a.compare_batch)]
    for variant in [""] + a.compare_variant:
        summary = compare_ours(run, view, flags, variant)
        if summary is None:
            break
        if variant:
            entry.setdefault("variants", {})[variant] = summary
        else:
            entry["ours"] = summary
    if "ours" not in entry:
        return
    if run.left() < 60:
        run.doc["skipped"].append("transformers: no time left")
        return
    t = time.monotonic()
    model, cls = load_transformers_model(view, a.device)
    import transformers

    entry["transformers"] = {"version": transformers.__version__, "class": cls,
                             "attn_implementation": model.config._attn_implementation,
                             "load_s": round(time.monotonic() - t, 1)}  # fmt: skip
    run.say(f"transformers {transformers.__version__} {cls} loaded in {entry['transformers']['load_s']} s")
    prompts = compare_prompts(a, cfg["vocab_size"])
    entry["transformers"].update(generate_throughput(model, prompts, a.compare_output_len))
    del model
    if a.device == "cuda":
        torch.cuda.empty_cache()
    ours, theirs = entry["ours"]["output_throughput"], entry["transformers"]["output_throughput"]
    entry["ratio_output_throughput"] = ours / theirs
    run.say(f"compare: ours {ours:.1f} out tok/s, transformers {theirs:.1f} -> {ours / theirs:.1f}x")
    for variant, summary in entry.get("variants", {}).items():
        summary["ratio_output_throughput"] = summary["output_throughput"] / theirs
        run.say(f"compare: ours with {variant} {summary['output_throughput']:.1f} out tok/s "
                f"-> {summary['ratio_output_throughput']:.1f}x")  # fmt: skip


def compare_ours(run: Run, view: str, flags: list[str], variant: str) -> dict | None:
    """The compare workload on a fresh server of ours with `variant`'s extra serve flags, run
    --compare-repeats times: the summary of the median run by output tok/s (all runs' output
    tok/s under "repeats_output_throughput"), or None when no run finished."""
    a = run.args
    tag = "compare" + ("-" + "".join(c if c.isalnum() else "-" for c in variant).strip("-") if variant else "")
    server = start_server(run, view, tag, a.compare_batch, shlex.split(variant))
    runs = []
    try:
        server.wait_ready()
        for k in range(a.compare_repeats):
            # The first run has the base seed: transformers gets its prompts (compare_prompts).
            doc = bench(run, server, f"{tag}-ours-{k}", flags, view, seed=a.seed + 7919 * k)
            if doc is None:
                break
            runs.append(doc["runs"][0]["summary"])
    finally:
        server.stop()
    if not runs:
        return None
    by_rate = sorted(runs, key=lambda r: r["output_throughput"])
    median = dict(by_rate[(len(by_rate) - 1) // 2])
    median["repeats_output_throughput"] = [r["output_throughput"] for r in runs]
    return median


def main(argv=None) -> int:
    args = parse_args(argv)
    run = Run(args)
    phases = [p for p in args.phases.split(",") if p]
    unknown = set(phases) - {"sweep", "shared", "compare"}
    if unknown:
        print(f"unknown phases {sorted(unknown)}: choose from sweep, shared, compare", file=sys.stderr)
        return 2
    rc = 0
    model_path = None
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none (cpu)"
        gpus = torch.cuda.device_count() if args.device == "cuda" else 0
        run.doc["machine"] = {"gpu": gpu, "gpus": gpus, "tp": args.tp, "torch": torch.__version__,
                              "cpus": os.cpu_count()}  # fmt: skip
        if args.device == "cuda" and args.tp > gpus:
            raise RuntimeError(f"--tp {args.tp} needs {args.tp} GPUs, this machine has {gpus}")
        bw = measure_copy_bandwidth(args.device, (4 << 30) if args.device == "cuda" else (64 << 20))
        run.doc["bandwidth_tb_s"] = round(bw / 1e12, 3)
        run.say(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
        # The tensor cores' ceiling for the step bound (on a CPU the matmul would take minutes and
        # mean nothing: none there).
        rate = measure_matmul_rate(args.device) if args.device == "cuda" else None
        if rate:
            run.doc["matmul_tflops"] = round(rate / 1e12, 1)
            run.say(f"bf16 matmul {rate / 1e12:.0f} TFLOP/s")
        model_path = ensure_checkpoint(run)
        roofline = DecodeRoofline(model_path, args.kv_cache_dtype, tp=args.tp,
                                  dp_attention="--enable-dp-attention" in args.serve_arg)  # fmt: skip
        run.doc["roofline_model"] = {"fixed_weight_gb": round(roofline.fixed_bytes / 1e9, 3),
                                     "expert_mb": round(roofline.expert_bytes / 1e6, 3), "moe_layers": roofline.moe_layers,
                                     "latent_row_bytes": roofline.latent_row, "index_row_bytes": roofline.index_row}  # fmt: skip
        run.save()
        # In the order given: sweep and shared share one server, started where the first of them is.
        served = False
        for phase in phases:
            if phase in ("sweep", "shared") and not served:
                phase_serving(run, model_path, roofline, bw, phases, rate)
                served = True
            elif phase == "compare":
                phase_compare(run, model_path)
            run.save()
    except Exception as e:  # report what ran; the failure goes into the results too
        import traceback

        run.doc["error"] = f"{type(e).__name__}: {e}"[:3000]
        run.say(f"ERROR {type(e).__name__}: {str(e)[:1500]}")
        run.log_file.write(traceback.format_exc())
        rc = 1
    finally:
        run.doc["targets"] = targets(run.doc)
        run.doc["elapsed_s"] = round(time.monotonic() - run.t0, 1)
        run.save()
        if model_path and not args.keep_model and not args.model_path:
            shutil.rmtree(model_path, ignore_errors=True)
        for log in run.work.glob("steps-*.jsonl"):  # the workers' step logs, for per-step analysis
            shutil.copy(log, Path(args.out) / log.name)
        shutil.rmtree(run.work, ignore_errors=True)
    table = summary_table(run.doc)
    run.log_file.write(table + "\n")
    print(table)
    return rc


if __name__ == "__main__":
    sys.exit(main())
