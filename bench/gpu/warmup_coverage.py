"""Does the warm-up cover serving? Random steps after it, counting the kernel variants they compile.

Builds the worker's executor as `nsaserve serve` does (warm-up and decode graphs included; worker
flags after --), then runs --steps random steps inside the warm-up's limits: decode batches of
random sizes and contexts, prompt chunks of random lengths after random cached prefixes, and
mixed steps of both. Before and after each step it counts the compiled variants of every Triton
and Gluon kernel in nsaserve.kernels; a step that compiled anything is listed with the kernels
and the seconds it took. A variant compiled while serving stalls every request of that step
(a 6-9 s compile on the H200 for the prompt top-k, 2026-12-02), so the answer wanted is none.

    python bench/gpu/warmup_coverage.py --model-path DIR --load-format random --steps 60 --out OUT/cov \\
        -- --warmup-tokens=16384 --warmup-batch=256

Writes OUT/coverage.json and OUT/coverage.md; prints the table last. TP=1, one GPU.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
import time
from pathlib import Path

import numpy as np
import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--load-format", default="safetensors", choices=["safetensors", "random"])
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--max-context", type=int, default=32768, help="longest context a random step reaches")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("worker_flags", nargs="*", help="after --: worker flags (--warmup-tokens, --warmup-batch, graphs)")
    return p.parse_args(argv)


def jit_kernels() -> dict[str, object]:
    """name -> every Triton / Gluon JIT function defined in nsaserve.kernels (autotuned and
    heuristics wrappers unwrapped)."""
    from triton.runtime.jit import JITFunction

    import nsaserve.kernels as pkg

    found: dict[str, object] = {}
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        module = importlib.import_module(info.name)
        for attr, value in vars(module).items():
            fn = value
            while fn is not None and not isinstance(fn, JITFunction):
                fn = getattr(fn, "fn", None)
            if fn is not None and getattr(fn, "__module__", module.__name__) == module.__name__:
                found[f"{info.name.rsplit('.', 1)[-1]}.{attr}"] = fn
    return found


def variant_counts(kernels: dict[str, object]) -> dict[str, int]:
    return {name: sum(len(cache[0]) for cache in fn.device_caches.values()) for name, fn in kernels.items()}


def pool_pages(a, limits: tuple[int, int]) -> int:
    """Pages random_plans needs: the shared prefix pages of the longest context, and each step's
    private pages (those its new tokens are written to)."""
    max_tokens, max_batch = limits
    return -(-(a.max_context + 1) // a.page_size) + max_tokens // a.page_size + 2 * (max_batch + 8) + 8


def random_plans(a, limits: tuple[int, int], vocab: int, num_pages: int):
    """(description, plan) of random steps inside the warm-up's limits (max tokens a step, max
    requests), over contexts up to --max-context. Requests read the same first pages of the pool
    (their cached prefixes: garbage, as the warm-up's are; timing and compiles are the point) and
    write their new tokens to pages of their own, so that every plan is one the worker would
    accept (no two tokens of a step write one slot)."""
    from nsaserve.protocol.builder import RequestSpec, build_plan

    max_tokens, max_batch = limits
    rng = np.random.default_rng(a.seed)
    ps = a.page_size
    shared_pages = -(-(a.max_context + 1) // ps)
    top = min(a.max_context, shared_pages * ps) - 1
    assert num_pages >= pool_pages(a, limits), "the pool is too small for random_plans"
    private = [shared_pages]  # the next page of the step's own

    def req(i: int, n_new: int, cached: int) -> RequestSpec:
        shared = cached // ps  # whole pages of the prefix only: the one it ends in is written to
        own = -(-(cached + n_new) // ps) - shared
        pages = list(range(shared)) + list(range(private[0], private[0] + own))
        private[0] += own
        return RequestSpec(i, rng.integers(0, vocab, n_new).tolist(), cached, pages)

    def log_uniform(lo: int, hi: int) -> int:
        return int(np.exp(rng.uniform(np.log(lo), np.log(max(lo + 1, hi)))))

    for step in range(a.steps):
        private[0] = shared_pages
        # This step's longest context, log-uniform (short and long steps both come up); its
        # requests' contexts spread below it. Every other step's longest context is a multiple of
        # 16: whole-context lists are as wide as it, and the sparse MLA kernels specialise their
        # index row stride on that (a gap of the warm-up, 2026-12-05, that uniformly drawn
        # contexts met one step in sixteen).
        cap = log_uniform(16, top)
        even = step % 2 == 1
        if even:
            cap = max(16, cap // 16 * 16)

        def context(new: int = 1, cap: int = cap) -> int:
            return int(rng.integers(0, max(1, min(cap, top - new))))

        def longest(new: int, cap: int = cap, even: bool = even) -> int:
            """The first request's cached length: its context is then the step's longest, cap
            itself on the even steps."""
            return max(0, min(cap, top) - new) if even else context(new)

        kind = ("decode", "prompt", "mixed")[step % 3]
        if kind == "decode":
            b = int(rng.integers(1, max_batch + 1))
            reqs = [req(i, 1, longest(1) if i == 0 else context()) for i in range(b)]
            desc = f"decode of {b}, longest context {max(r.cached_len for r in reqs) + 1}"
        elif kind == "prompt":
            n = int(min(max_tokens, np.exp(rng.uniform(np.log(16), np.log(max_tokens)))))
            c = longest(n) if rng.random() < 0.7 else 0
            reqs = [req(0, n, c)]
            desc = f"prompt of {n} after {c}"
        else:
            k = int(rng.integers(2, 9))
            n = max(1, int(rng.integers(16, max(17, max_tokens // (2 * k)))))
            chunks = [req(i, n, longest(n) if i == 0 else context(n)) for i in range(k)]
            d = int(rng.integers(1, max(2, max_batch - k)))
            reqs = chunks + [req(k + i, 1, context()) for i in range(d)]
            desc = f"mixed: {k} chunks of {n} and {d} decode rows, longest context {chunks[0].cached_len + n}"
        yield desc, build_plan(step, a.page_size, reqs)


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from nsaserve.worker.main import parse_args as worker_args
    from nsaserve.worker.model_executor import ModelExecutor

    args_limits = worker_args(["--rank=0", "--tp-size=1", *a.worker_flags])
    limits = (max(16, args_limits.warmup_tokens), max(1, args_limits.warmup_batch))
    num_pages = pool_pages(a, limits)
    flags = ["--rank=0", "--tp-size=1", f"--model-path={a.model_path}", "--device=cuda", f"--kv-cache-dtype={a.kv_cache_dtype}",
             f"--page-size={a.page_size}", f"--load-format={a.load_format}", f"--num-pages={num_pages}"]  # fmt: skip
    args = worker_args(flags + list(a.worker_flags))
    torch.cuda.set_device(0)
    kernels = jit_kernels()
    t0 = time.perf_counter()
    executor = ModelExecutor.from_args(args)  # loads, captures graphs, warms up
    ready_s = time.perf_counter() - t0
    after_warmup = variant_counts(kernels)
    rows = []
    for desc, plan in random_plans(a, limits, executor.vocab_size, num_pages):
        before = variant_counts(kernels)
        torch.cuda.synchronize()
        t = time.perf_counter()
        executor.run(plan, is_rank0=True)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
        now = variant_counts(kernels)
        grew = {k: now[k] - before[k] for k in now if now[k] > before[k]}
        rows.append({"step": desc, "ms": round(ms, 1), "graph": executor.graphs is not None and executor.graphs.fits(plan),
                     "compiled": grew})  # fmt: skip
        print(f"{desc}: {ms:.1f} ms" + (f", compiled {grew}" if grew else ""), flush=True)
    compiling = [r for r in rows if r["compiled"]]
    doc = {
        "command": " ".join(["bench/gpu/warmup_coverage.py", *sys.argv[1:]]),
        "machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__},
        "ready_s": round(ready_s, 1),
        "variants_after_warmup": sum(after_warmup.values()),
        "kernels_with_variants": sorted(k for k, v in after_warmup.items() if v),
        "steps": rows,
        "steps_that_compiled": len(compiling),
    }
    (out / "coverage.json").write_text(json.dumps(doc, indent=1))
    lines = [f"# Warm-up coverage: {len(rows)} random steps, {len(compiling)} compiled a kernel variant", "",
             f"Command: `{doc['command']}`; ready (load, graphs, warm-up) in {doc['ready_s']} s, "
             f"{doc['variants_after_warmup']} variants of {len(doc['kernels_with_variants'])} kernels compiled by then.", "",
             "| step | ms | graph | compiled |", "|---|---:|---|---|"]  # fmt: skip
    lines += [f"| {r['step']} | {r['ms']} | {r['graph']} | {', '.join(f'{k} +{v}' for k, v in r['compiled'].items())} |" for r in rows]
    table = "\n".join(lines) + "\n"
    (out / "coverage.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
