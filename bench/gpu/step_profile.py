"""Where one step's time goes, per kernel family, at any tensor-parallel size.

Every rank builds the worker's own executor (ModelExecutor.from_args: the same backends, KV cache
and decode graphs as `nsaserve serve`), then runs synthetic steps through it: decode batches of B
requests with C tokens of context each, or contexts spread over a range as in serving (graph replay
when a graph fits, and eagerly), a prefill
of R prompts of L tokens, and an extend step: R requests of N new tokens each after C cached ones
(a radix-cache hit's prefill). Each scenario is timed over --steps steps (median), then run once
more under torch.profiler; rank 0 groups the device kernels into families (routed experts, sparse
MLA, indexer, top-k, GEMMs, NCCL, norms/RoPE, KV stores, sampling, other) and writes the table.
Decode scenarios are also run back to back as --worker-pipeline runs them (each step launched
before the previous one's result is built): "pipelined step ms" against "step ms" is the host
time per step that the pipeline hides.
KV contents are whatever the pool holds (zeros): timing, not output, is the point.

    python bench/gpu/step_profile.py --model-path DIR [--load-format random] --tp 4 \\
        --decode 64x1400,512x1400,256x819-2048 --prefill 16x1024 --extend 256x33x1024 --out OUT/prof [-- worker flags]

Worker flags after -- change what runs, e.g. `-- --dense-prefill=off` (sparse prompt attention only) or
`-- --warmup-tokens=16384` (the serving warm-up first; the first-call column then shows no compile).

Writes OUT/profile.json and OUT/profile.md; prints the markdown table last. On CPU (gloo) it runs
the same code for a functional check; the families then hold CPU operators.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

FAMILIES = [
    ("nccl", r"nccl|all_reduce|allreduce|all_gather|allgather|reduce_scatter"),
    # The profiler names Triton's MoE kernels without their "_moe" prefix (_gate_up_kernel, ...).
    ("moe_experts", r"moe|w4a16|expert|^_gate_up_kernel|^_down_kernel|^_align\w*_kernel|^_sum_kernel"),
    ("sparse_mla", r"sparse_mla|mla|flash|^_combine_kernel"),
    ("indexer", r"indexer|index_score|fold|^_logits_kernel"),
    ("topk", r"topk|top_k|radix_select|bitonic"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|sm90_|cublas|matmul|addmm|^aten::mm|linear"),
    ("norm_rope", r"norm|rope|rotary"),
    ("kv_store", r"kv_store|store|quant"),
    ("sampling", r"sort|argmax|exponential|gumbel|softmax|multinomial|sampl"),
]


def family(name: str) -> str:
    low = name.lower()
    for fam, pattern in FAMILIES:
        if re.search(pattern, low):
            return fam
    return "other"


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """"64x1400,512x1400" -> [(64, 1400), (512, 1400)]; "256x33x1024" -> [(256, 33, 1024)]."""
    return [tuple(int(v) for v in item.split("x")) for item in filter(None, text.split(","))]


# Orders of a decode batch's spread contexts: as requests arrive in serving (a fixed shuffle), or
# longest / shortest first.
CONTEXT_ORDERS = {"": "shuffled", "d": "longest first", "a": "shortest first"}


def parse_decode(text: str) -> list[tuple[str, list[int]]]:
    """Decode scenarios -> (name, context of each request). "64x1400": 64 requests of 1400 tokens;
    "256x819-2048": 256 contexts spread evenly over 819..2048 (serving's mix of prompt and output
    lengths), in a fixed shuffled order; a "d" or "a" suffix ("256x819-2048d") orders them longest
    or shortest first instead. Spread contexts show what equal ones hide: work split by context
    (sparse MLA programs per row, the split of each row's list) ends with the longest."""
    out = []
    for item in filter(None, text.split(",")):
        batch, ctx = item.split("x")
        b = int(batch)
        order = ctx[-1] if ctx[-1] in "da" else ""
        lo, _, hi = ctx.rstrip("da").partition("-")
        lo, hi = int(lo), int(hi or lo)
        if not (b > 0 and 0 < lo <= hi):
            raise ValueError(f"decode scenario {item!r}: BATCHxCONTEXT or BATCHxLO-HI[d|a], 0 < LO <= HI")
        contexts = [lo + (hi - lo) * i // max(1, b - 1) for i in range(b)]
        if order == "d":
            contexts.reverse()
        elif not order and hi > lo:
            perm = torch.randperm(b, generator=torch.Generator().manual_seed(1)).tolist()
            contexts = [contexts[i] for i in perm]
        out.append((f"decode {item}" if hi > lo else f"decode {b}x{lo}", contexts))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--load-format", default="safetensors", choices=["safetensors", "random"])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument(
        "--decode", default="64x1400",
        help="decode scenarios, BATCHxCONTEXT or BATCHxLO-HI[d|a] (spread contexts, parse_decode), comma-separated",
    )  # fmt: skip
    p.add_argument("--prefill", default="16x1024", help="prefill scenarios, PROMPTSxLENGTH, comma-separated")
    p.add_argument("--extend", default="", help="prefill after a cached prefix, REQUESTSxNEWxCACHED, comma-separated")
    p.add_argument("--steps", type=int, default=5, help="timed steps per scenario (median reported)")
    p.add_argument("--top", type=int, default=12, help="kernels listed per scenario")
    p.add_argument("--sampling", default="{}",
                   help='decode requests\' sampling, JSON of protocol.builder.SamplingSpec fields, e.g. '
                        '\'{"top_p": 0.95, "frequency_penalty": 0.2, "seed": 7, "top_logprobs": 5}\'; with a penalty, '
                        'each request\'s history is its whole context (the last 200 tokens generated). Default: temperature 1')  # fmt: skip
    p.add_argument("--sources", type=int, default=0,
                   help="also list the N torch operators of each eager step that take the most device "
                        "time, each with the nsaserve source line that called it (the small kernels to fuse)")  # fmt: skip
    p.add_argument("--host-profile", type=int, default=0,
                   help="also run N eager steps of each decode scenario under cProfile and list the Python "
                        "functions with the most host time a step")  # fmt: skip
    p.add_argument("--out", required=True)
    p.add_argument("worker_flags", nargs="*", help="after --: extra worker flags (e.g. --attention-backend torch)")
    return p.parse_args(argv)


def _pages_needed(a) -> int:
    ps = a.page_size
    need = [sum(-(-(c + 2) // ps) for c in contexts) for _, contexts in parse_decode(a.decode)]
    need += [r * -(-(n + 1) // ps) for r, n in parse_shapes(a.prefill)]
    need += [r * -(-(n + c + 1) // ps) for r, n, c in parse_shapes(a.extend)]
    return max(need + [1]) + 8


def _plans(a, vocab: int):
    """(name, kind, plan) for every scenario; request pages laid out one after another."""
    from nsaserve.protocol.builder import RequestSpec, SamplingSpec, build_plan

    ps, g = a.page_size, torch.Generator().manual_seed(0)
    sampling = SamplingSpec(**json.loads(a.sampling))
    penalised = RequestSpec(0, [0], 0, [], sampling=sampling).resets_history()
    out = []
    for name, contexts in parse_decode(a.decode):
        reqs, first = [], 0
        for i, c in enumerate(contexts):
            per = -(-(c + 1) // ps)
            reqs.append(RequestSpec(i, [int(torch.randint(vocab, (1,), generator=g))], c,
                                    list(range(first, first + per)), sampling=sampling))  # fmt: skip
            first += per
        for r, c in zip(reqs if penalised else (), contexts):
            r.history = torch.randint(vocab, (c,), generator=g).tolist()
            r.history_prompt_len = max(c - 200, 0)
        out.append((name, "decode", build_plan(1, ps, reqs)))
    for r, n in parse_shapes(a.prefill):
        per = -(-(n + 1) // ps)
        reqs = [RequestSpec(i, torch.randint(vocab, (n,), generator=g).tolist(), 0, list(range(i * per, (i + 1) * per)))
                for i in range(r)]  # fmt: skip
        out.append((f"prefill {r}x{n}", "prefill", build_plan(1, ps, reqs)))
    for r, n, c in parse_shapes(a.extend):
        per = -(-(n + c + 1) // ps)
        reqs = [RequestSpec(i, torch.randint(vocab, (n,), generator=g).tolist(), c, list(range(i * per, (i + 1) * per)))
                for i in range(r)]  # fmt: skip
        out.append((f"extend {r}x{n} after {c}", "prefill", build_plan(1, ps, reqs)))
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(executor, plan, device, steps: int, is_rank0: bool) -> list[float]:
    """Wall ms of steps + 2 calls; the caller drops the first two (warm-ups) from the median and
    reports the first alone: it includes compiling any kernel variant the scenario is first to use."""
    ms = []
    for _ in range(steps + 2):  # two warm-ups
        _sync(device)
        t = time.perf_counter()
        executor.run(plan, is_rank0=is_rank0)
        _sync(device)
        ms.append((time.perf_counter() - t) * 1e3)
    return ms


def _time_pipelined(executor, plan, device, steps: int, is_rank0: bool) -> float:
    """ms per step of `steps` decode steps run as --worker-pipeline runs them: each launched before
    the previous one's result is built, so the host work between two steps overlaps the device's."""
    _sync(device)
    t = time.perf_counter()
    prev = executor.launch(plan, is_rank0)
    for _ in range(steps - 1):
        cur = executor.launch(plan, is_rank0)
        executor.finish(prev)
        prev = cur
    executor.finish(prev)
    _sync(device)
    return (time.perf_counter() - t) * 1e3 / steps


def _split(ms: list[float]) -> tuple[float, list[float]]:
    """(the first call's ms, the timed calls' ms) of _time's list."""
    return round(ms[0], 3), ms[2:]


def _profile(executor, plan, device, is_rank0: bool, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        executor.run(plan, is_rank0=is_rank0)
        _sync(device)
    cuda = device.type == "cuda"
    rows = []
    for e in prof.key_averages():
        us = (getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)) if cuda else e.self_cpu_time_total
        if us > 0 and (not cuda or e.device_type == torch.autograd.DeviceType.CUDA):
            rows.append((e.key, us / 1e3, e.count))
    if not cuda:  # CPU: keep leaf-ish operators only (aten ops), not the Python frames around them
        rows = [r for r in rows if r[0].startswith("aten::")]
    fams: dict[str, float] = {}
    for name, ms, _ in rows:
        fams[family(name)] = fams.get(family(name), 0.0) + ms
    rows.sort(key=lambda r: -r[1])
    out = {
        "families_ms": dict(sorted(fams.items(), key=lambda kv: -kv[1])),
        "kernels_total_ms": sum(r[1] for r in rows),
        "top": [{"name": n[:120], "ms": round(ms, 4), "calls": c, "family": family(n)} for n, ms, c in rows[:top]],
    }
    if cuda:
        spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]  # fmt: skip
        out["timeline"] = timeline(spans, top)
    return out


def timeline(spans: list[tuple[float, float, str]], top: int) -> dict:
    """The device's idle time inside one step: spans (start us, end us, kernel name) of every
    device activity. span_ms runs from the first start to the last end; idle_ms is the part of it
    no activity covers (launch gaps between dependent kernels, host waits); gaps lists the kernel
    pairs (the one that ended -> the one that started next) with the most idle time between them."""
    if not spans:
        return {"kernels": 0, "span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "gaps": []}
    spans = sorted(spans)
    busy, end, prev = 0.0, spans[0][0], spans[0][2]
    gaps: dict[tuple[str, str], list[float]] = {}
    for start, stop, name in spans:
        if start > end:  # idle from the latest end so far to this start
            acc = gaps.setdefault((prev[:60], name[:60]), [0.0, 0])
            acc[0] += start - end
            acc[1] += 1
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, prev = stop, name
    span = end - spans[0][0]
    ranked = sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "kernels": len(spans),
        "span_ms": round(span / 1e3, 4),
        "busy_ms": round(busy / 1e3, 4),
        "idle_ms": round((span - busy) / 1e3, 4),
        "gaps": [{"after": a, "before": b, "us": round(us, 1), "count": n} for (a, b), (us, n) in ranked],
    }


def _short_path(path: str) -> str:
    """A profiled function's file from the project's package or bench/ on ("nsaserve/worker/x.py",
    installed or not), else from site-packages/ or the standard library's directory on."""
    own = re.search(r"(?:^|/)((?:nsaserve|bench)/.*)$", path)
    if own:
        return own.group(1)
    if "site-packages/" in path:
        return "site-packages/" + path.rsplit("site-packages/", 1)[1]
    return re.sub(r"^.*?(python3\.\d+/)", r"\1", path)


def _host_profile(executor, plan, device, is_rank0: bool, steps: int, top: int) -> dict:
    """Host time per Python function over `steps` eager steps (cProfile, ms a step): where an
    eager step's launches spend the host's time. "own": the functions with the most time in their
    own code; "cum": the project's functions with the most time including their callees."""
    import cProfile
    import pstats

    _sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        executor.run(plan, is_rank0=is_rank0)
    _sync(device)
    prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (path, line, fn), (_cc, calls, tottime, cumtime, _callers) in st.stats.items():
        where = _short_path(path)
        rows.append({"function": f"{where}:{line}({fn})", "calls": calls // steps,
                     "own_ms": round(tottime * 1e3 / steps, 3), "cum_ms": round(cumtime * 1e3 / steps, 3)})  # fmt: skip
    own = sorted(rows, key=lambda r: -r["own_ms"])[:top]
    cum = sorted((r for r in rows if r["function"].startswith("nsaserve/")), key=lambda r: -r["cum_ms"])[:top]
    return {"own": own, "cum": cum}


def _source_line(stack: list[str]) -> str:
    """The innermost frame of the project's own code in a profiler stack ("path(line): function")."""
    for frame in stack:
        if "nsaserve" in frame or "/bench/" in frame:
            return _short_path(frame)
    return stack[0] if stack else "?"


def _sources(executor, plan, device, is_rank0: bool, top: int) -> list[dict]:
    """Device time per (torch operator, calling source line) of one eager step: where the many small
    launches that are not the model's own kernels come from. Triton kernels have no operator and are
    left out (the kernel list names them). On CPU: the operators' own CPU time."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # verbose: without it torch 2.11 records no Python stacks on the operators
    with profile(activities=acts, with_stack=True, experimental_config=_ExperimentalConfig(verbose=True)) as prof:
        executor.run(plan, is_rank0=is_rank0)
        _sync(device)
    by: dict[tuple[str, str], list[float]] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or not e.name.startswith("aten::"):
            continue
        us = (getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)) if cuda else e.self_cpu_time_total
        if us <= 0:
            continue
        key = (e.name, _source_line(list(e.stack or [])))
        acc = by.setdefault(key, [0.0, 0])
        acc[0] += us / 1e3
        acc[1] += 1
    rows = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"op": op, "source": src, "ms": round(ms, 4), "calls": n} for (op, src), (ms, n) in rows]


def _rank(rank: int, a, port: int) -> None:
    from nsaserve.worker.distributed import init_distributed
    from nsaserve.worker.main import parse_args as worker_args
    from nsaserve.worker.model_executor import ModelExecutor

    flags = [f"--rank={rank}", f"--tp-size={a.tp}", f"--model-path={a.model_path}", f"--device={a.device}",
             f"--kv-cache-dtype={a.kv_cache_dtype}", f"--page-size={a.page_size}", f"--load-format={a.load_format}",
             f"--num-pages={_pages_needed(a)}", f"--dist-init-method=tcp://127.0.0.1:{port}"]  # fmt: skip
    decode = parse_decode(a.decode)
    if decode:  # one graph per decode batch size, so the graph and eager timings cover the same steps
        flags.append("--cuda-graph-bs=" + ",".join(str(b) for b in sorted({len(c) for _, c in decode})))
        flags.append(f"--cuda-graph-max-context={max(max(c) for _, c in decode) + 1}")
    args = worker_args(flags + list(a.worker_flags))
    if a.tp > 1:
        init_distributed(args)
    elif a.device == "cuda":
        torch.cuda.set_device(0)
    executor = ModelExecutor.from_args(args)
    device = executor.device
    is_rank0 = rank == 0
    results = []
    for name, kind, plan in _plans(a, executor.vocab_size):
        entry = {"scenario": name}
        graphs = executor.graphs
        if kind == "decode" and graphs is not None and graphs.fits(plan):
            entry["first_ms"], entry["graph_ms"] = _split(_time(executor, plan, device, a.steps, is_rank0))
            entry["graph_profile"] = _profile(executor, plan, device, is_rank0, a.top)
            executor.graphs = None  # the same steps eagerly
            entry["eager_ms"] = _time(executor, plan, device, a.steps, is_rank0)[2:]
            entry["eager_profile"] = _profile(executor, plan, device, is_rank0, a.top)
            if a.sources:
                entry["sources"] = _sources(executor, plan, device, is_rank0, a.sources)
            executor.graphs = graphs
        else:
            entry["first_ms"], entry["eager_ms"] = _split(_time(executor, plan, device, a.steps, is_rank0))
            entry["eager_profile"] = _profile(executor, plan, device, is_rank0, a.top)
            if a.sources:
                entry["sources"] = _sources(executor, plan, device, is_rank0, a.sources)
        if a.host_profile and kind == "decode":  # eagerly, as the eager timings ran
            executor.graphs = None
            entry["host_profile"] = _host_profile(executor, plan, device, is_rank0, a.host_profile, 3 * a.top)
            executor.graphs = graphs
        if kind == "decode":  # back to back, pipelined (graphs where one fits): the step rate with the host hidden
            entry["pipelined_ms"] = _time_pipelined(executor, plan, device, max(a.steps, 3), is_rank0)
        results.append(entry)
    if is_rank0:
        doc = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(sys.argv),
            "machine": {
                "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else "none (cpu)",
                "tp": a.tp,
                "torch": torch.__version__,
            },
            "backends": dict(executor.runner.model.backends),
            # Kernel switches set by environment variables (the MoE stacks' layout among them).
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NSASERVE_")},
            "graphs": graphs is not None,
            "scenarios": results,
        }
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile.json").write_text(json.dumps(doc, indent=2) + "\n")
        (out / "profile.md").write_text(markdown(doc))


def markdown(doc: dict) -> str:
    lines = [f"# Step profile ({doc['machine']}, {doc['date']})", "", f"Command: `{doc['command']}`", "",
             f"Backends: {doc['backends']}", f"Environment: {doc.get('env') or 'none'}", ""]  # fmt: skip
    fams = [f for f, _ in FAMILIES] + ["other"]
    head = ("| scenario | path | first call ms | step ms (median) | pipelined step ms | kernels ms | "
            "device span ms | device idle ms | launches | " + " | ".join(fams) + " |")  # fmt: skip
    lines += [head, "|" + "---|" * (9 + len(fams))]
    for s in doc["scenarios"]:
        for path in ("graph", "eager"):
            if f"{path}_ms" not in s:
                continue
            p = s[f"{path}_profile"]
            cells = [f"{p['families_ms'].get(f, 0.0):.2f}" for f in fams]
            primary = path == "graph" or "graph_ms" not in s
            first = f"{s['first_ms']:.1f}" if primary else ""
            piped = f"{s['pipelined_ms']:.2f}" if primary and "pipelined_ms" in s else ""
            t = p.get("timeline")
            tl = f"{t['span_ms']:.2f} | {t['idle_ms']:.2f} | {t['kernels']}" if t else " | | "
            lines.append(f"| {s['scenario']} | {path} | {first} | {statistics.median(s[f'{path}_ms']):.2f} | {piped} | "
                         f"{p['kernels_total_ms']:.2f} | {tl} | " + " | ".join(cells) + " |")  # fmt: skip
    for s in doc["scenarios"]:
        for path in ("graph", "eager"):
            if f"{path}_profile" in s:
                lines += ["", f"Top kernels, {s['scenario']} ({path}):", ""]
                lines += [f"- {k['ms']:.3f} ms x{k['calls']} [{k['family']}] `{k['name']}`" for k in s[f"{path}_profile"]["top"]]
        for path in ("graph", "eager"):
            gaps = s.get(f"{path}_profile", {}).get("timeline", {}).get("gaps")
            if gaps:
                lines += ["", f"Device idle between kernels, {s['scenario']} ({path}), largest totals:", ""]
                lines += [f"- {g['us']:.1f} us x{g['count']}: `{g['after']}` -> `{g['before']}`" for g in gaps]
        if s.get("host_profile"):
            for kind, label in (("own", "own time"), ("cum", "time with callees")):
                lines += ["", f"Host ms a step by function ({label}), {s['scenario']} (eager):", ""]
                lines += [f"- {r['own_ms' if kind == 'own' else 'cum_ms']:.3f} ms x{r['calls']} `{r['function']}`"
                          for r in s["host_profile"][kind]]  # fmt: skip
        if s.get("sources"):
            lines += ["", f"Torch operators by calling line, {s['scenario']} (eager):", ""]
            lines += [f"- {r['ms']:.3f} ms x{r['calls']} `{r['op']}` at `{r['source']}`" for r in s["sources"]]
    return "\n".join(lines) + "\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    a = parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    port = _free_port()
    if a.tp == 1:
        _rank(0, a, port)
    else:
        import torch.multiprocessing as mp

        mp.spawn(_rank, args=(a, port), nprocs=a.tp, join=True)
    print((Path(a.out) / "profile.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
