"""Kernel variants compiled while serving: once the warm-up is done, every Triton (or Gluon)
kernel variant compiled on a step's path is logged with its kernel, its constexprs, the step it
stalled and the seconds it took, and counted in the step log (NSASERVE_STEP_LOG: "compiles",
"compile_s").

Why: a compile on the serving path stalls every request of its step (6-9 s for one variant of
the prompt top-k on the H200, 2026-12-02; a 1.8 s mixed step in a 256-concurrent run on the H100,
2026-12-05). The warm-up (worker/warmup.py) exists to compile, before the first request, every
variant serving can meet; this says which ones it missed, where and when, without a profiler or
a coverage run (bench/gpu/warmup_coverage.py).

How: JITFunction._do_compile is what a Triton kernel launch calls when the variant is missing
from the kernel's in-memory cache (Gluon kernels inherit it); the watch wraps it with a timer.
A variant found in Triton's on-disk cache passes through it too, in milliseconds, and is logged
the same way: the warm-up missed it all the same. Not Triton's own compile hooks
(knobs.runtime.jit_cache_hook): with a hook set, Triton 3.6 first serialises the variant's
constants to JSON, which raises on our kernels' constexpr values (Gluon layouts, nested
constexprs) and failed the steps that compiled (found on the H100, 2026-12-05). Whatever the
watch does, a compile's result or error passes through unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable

_ACTIVE: CompileWatch | None = None
_ORIGINAL = None  # JITFunction._do_compile before install()


class CompileWatch:
    def __init__(self, log: Callable[[str], None] | None = None):
        """log: where each compile is reported (rank 0's worker log); None counts only."""
        self.log = log
        self.count = 0  # variants compiled since install()
        self.seconds = 0.0
        self.plan = None  # the plan being launched (ModelExecutor.launch sets it), named in the log
        self._taken = (0, 0.0)

    def compiled(self, jit_function, constexprs, options, seconds: float) -> None:
        self.count += 1
        self.seconds += seconds
        if self.log is not None:
            p = self.plan
            at = f" in step {p.step} ({p.mode}, {p.num_reqs} requests, {p.num_tokens} tokens)" if p is not None else ""
            what = describe(jit_function, constexprs, options)
            self.log(f"compiled {kernel_name(jit_function)} while serving{at}: {seconds:.2f} s ({what})")

    def take(self) -> tuple[int, float]:
        """(variants compiled, seconds) since the last take: one step's share."""
        before = self._taken
        self._taken = (self.count, self.seconds)
        return self.count - before[0], self.seconds - before[1]


def kernel_name(jit_function) -> str:
    """"module.kernel" of a JIT function (the module without the package's prefix)."""
    fn = getattr(jit_function, "fn", None)
    module = getattr(fn, "__module__", "") or ""
    return f"{module.removeprefix('nsaserve.kernels.')}.{getattr(fn, '__qualname__', '?')}"


def describe(jit_function, constexprs, options, limit: int = 400) -> str:
    """The variant's constexprs by parameter name, e.g. "BLOCK_M=8, PAIRED=True", and its launch
    options: what tells one variant of a kernel from another."""
    params = getattr(jit_function, "params", None) or []
    parts = []
    for path, value in (constexprs or {}).items():
        i = path[0] if isinstance(path, tuple) and path else path
        name = params[i].name if isinstance(i, int) and i < len(params) else str(path)
        parts.append(f"{name}={getattr(value, 'value', value)}")
    for option in ("num_warps", "num_stages"):  # (a Gluon kernel's num_warps comes as a constexpr)
        value = getattr(options, option, "?")
        parts.append(f"{option}={getattr(value, 'value', value)}")
    text = ", ".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _timed_do_compile(self, *args, **kwargs):
    t0 = time.perf_counter()
    kernel = _ORIGINAL(self, *args, **kwargs)
    watch = _ACTIVE
    if watch is not None:
        try:  # (key, signature, device, constexprs, options, attrs, warmup)
            constexprs = args[3] if len(args) > 3 else kwargs.get("constexprs")
            options = args[4] if len(args) > 4 else kwargs.get("options")
            watch.compiled(self, constexprs, options, time.perf_counter() - t0)
        except Exception:  # reporting must never fail the step that compiled
            pass
    return kernel


def install(log: Callable[[str], None] | None = None) -> CompileWatch | None:
    """Watch every compile from now on (call it after the warm-up). None where Triton is absent."""
    global _ACTIVE, _ORIGINAL
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    if _ORIGINAL is None:
        _ORIGINAL = JITFunction._do_compile
        JITFunction._do_compile = _timed_do_compile
    _ACTIVE = CompileWatch(log)
    return _ACTIVE


def uninstall() -> None:
    global _ACTIVE, _ORIGINAL
    if _ORIGINAL is not None:
        from triton.runtime.jit import JITFunction

        JITFunction._do_compile = _ORIGINAL
        _ORIGINAL = None
    _ACTIVE = None


def active() -> CompileWatch | None:
    return _ACTIVE
