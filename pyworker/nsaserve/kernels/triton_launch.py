"""A shorter host path for launching already compiled Triton kernels (Triton 3.x JITFunction).

`kernel[grid](*args)` runs JITFunction.run on every call: bind and specialise the arguments, build a
cache key string from the specialisation and the options (str() of a dict), look the kernel up,
check the kernel's global constants, build launch metadata for the launch hooks, then launch. On an
H200 host that is ~22 us per launch, of which the C launcher is ~8 us and the binder ~5 us.

enable() gives each JITFunction of the given modules a `run` that keeps Triton's own binder (so
every argument is specialised exactly as Triton does: dtypes, 16-byte alignment, integers equal to
1 or divisible by 16, constexpr values) and looks the compiled kernel up by that specialisation
tuple and the options in a dict of its own, then calls the launcher directly. A miss, a warm-up
call, pre-run hooks or launch hooks (profilers) take Triton's own path, which compiles and launches
as always; the kernel it returns is remembered. disable() restores Triton's path.

The global-constant check is skipped: the kernels here read module constants that never change.
Interpreted functions (TRITON_INTERPRET=1, CPU tests) are left alone.

Measured on an H200 (bench/results/2026-11-29-eager-step-host.md): no consistent gain per step
within that host's noise, so the model leaves it off unless NSASERVE_TRITON_FAST_LAUNCH=1.
"""

from __future__ import annotations

import sys
import types

from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

_PATCHED: dict[int, JITFunction] = {}


def _fast_run(self, *args, grid, warmup, **kwargs):
    rt = knobs.runtime
    if warmup or self.pre_run_hooks or rt.launch_enter_hook is not None or rt.launch_exit_hook is not None:
        return JITFunction.run(self, *args, grid=grid, warmup=warmup, **kwargs)
    kwargs["debug"] = kwargs.get("debug", self.debug) or rt.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    device = driver.active.get_current_device()
    binder = self.device_caches[device][4]
    bound_args, specialization, options = binder(*args, **kwargs)
    key = (device, tuple(specialization), tuple(options.items()))
    kernel = self._fast_kernels.get(key)
    if kernel is None:
        kernel = JITFunction.run(self, *args, grid=grid, warmup=False, **kwargs)
        if kernel is not None and not hasattr(kernel, "result"):  # not a pending asynchronous compile
            self._fast_kernels[key] = kernel
        return kernel
    if callable(grid):
        grid = grid(bound_args)
    n = len(grid)
    kernel.run(
        grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, driver.active.get_current_stream(device),
        kernel.function, kernel.packed_metadata, None, None, None, *bound_args.values(),
    )  # fmt: skip
    return kernel


def _jit_functions(module) -> list[JITFunction]:
    return [v for v in vars(module).values() if isinstance(v, JITFunction)]


def enable(module_prefix: str = "nsaserve.kernels.triton_") -> int:
    """Give the JITFunctions of every imported module named module_prefix* the short launch path;
    returns how many have it now. Call again after importing more kernel modules."""
    for name, module in list(sys.modules.items()):
        if name.startswith(module_prefix) and module is not None and name != __name__:
            for fn in _jit_functions(module):
                if id(fn) not in _PATCHED:
                    fn._fast_kernels = {}
                    fn.run = types.MethodType(_fast_run, fn)
                    _PATCHED[id(fn)] = fn
    return len(_PATCHED)


def disable() -> None:
    """Back to Triton's own launch path for every function enable() changed."""
    for fn in _PATCHED.values():
        fn.__dict__.pop("run", None)
        fn.__dict__.pop("_fast_kernels", None)
    _PATCHED.clear()


def enabled() -> bool:
    return bool(_PATCHED)
