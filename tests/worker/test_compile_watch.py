"""Kernel variants compiled while serving (worker/compile_watch.py): the wrapped compile path logs
the kernel, its constexprs and the step it stalled, and the step log counts them.

No compile happens on the CPU (the interpreter runs kernels as Python), so these tests stand a
fake in for the compile itself and go through the wrapper as Triton's launch does
(JITFunction._do_compile with its positional arguments); the signature test fails on a Triton
whose _do_compile takes other arguments. The CUDA test compiles a real kernel."""

import inspect
import json

import pytest
import torch

from nsaserve.protocol.builder import RequestSpec, build_plan
from nsaserve.serve import EMBEDDED_MODEL
from nsaserve.worker import compile_watch
from nsaserve.worker.main import parse_args

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from triton.runtime.jit import JITFunction  # noqa: E402


def _scale_kernel(x_ptr, n, BLOCK: tl.constexpr, PAIRED: tl.constexpr):  # wrapped, never run
    pass


SCALE = JITFunction(_scale_kernel)


@triton.jit
def _add_one_kernel(x_ptr, n, BLOCK: tl.constexpr):  # the CUDA test's real compile
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)


def add_one(x):
    _add_one_kernel[(triton.cdiv(x.numel(), 128),)](x, x.numel(), BLOCK=128)


def compile_through_triton(result="kernel"):
    """A launch's call on a cache miss: _do_compile(key, signature, device, constexprs, options, attrs, warmup)."""
    from triton.backends.nvidia.compiler import CUDAOptions

    sig = {"x_ptr": "*bf16", "n": "i32", "BLOCK": "constexpr", "PAIRED": "constexpr"}
    consts = {(2,): tl.constexpr(64), (3,): True}
    options = CUDAOptions(num_warps=tl.constexpr(4), num_stages=3)  # as a Gluon launch passes num_warps
    return JITFunction._do_compile(SCALE, "key", sig, 0, consts, options, {}, False)


@pytest.fixture
def watch(monkeypatch):
    lines: list[str] = []
    w = compile_watch.install(lines.append)
    # The compile itself, faked (no GPU): what the wrapper times and passes through.
    monkeypatch.setattr(compile_watch, "_ORIGINAL", lambda self, *a, **k: ("compiled", self, a[3]))
    yield w, lines
    monkeypatch.undo()
    compile_watch.uninstall()


def test_the_wrapped_compile_takes_the_arguments_triton_passes():
    params = list(inspect.signature(JITFunction._do_compile).parameters)
    assert params == ["self", "key", "signature", "device", "constexprs", "options", "attrs", "warmup"]


def test_a_compile_is_logged_with_its_kernel_constexprs_and_step(watch):
    w, lines = watch
    w.plan = build_plan(7, 4, [RequestSpec(0, [5, 6, 7], 0, [0]), RequestSpec(1, [8], 9, [1, 2, 3])])
    out = compile_through_triton()
    assert out[0] == "compiled" and out[1] is SCALE  # the compile's result, unchanged
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("compiled ") and "test_compile_watch._scale_kernel while serving in step 7 (mixed, 2 requests, 4 tokens)" in line
    assert "BLOCK=64" in line and "PAIRED=True" in line and "num_warps=4, num_stages=3" in line
    n, seconds = w.take()
    assert n == 1 and 0 <= seconds < 5
    assert w.take() == (0, 0.0)  # taken once: the next step's share starts at zero


def test_a_failing_compile_raises_as_before_and_is_not_counted(watch, monkeypatch):
    w, lines = watch

    def broken(self, *a, **k):
        raise RuntimeError("ptxas failed")

    monkeypatch.setattr(compile_watch, "_ORIGINAL", broken)
    with pytest.raises(RuntimeError, match="ptxas failed"):
        compile_through_triton()
    assert lines == [] and w.count == 0


def test_reporting_never_fails_the_compile(watch):
    w, _ = watch

    def bad_log(_):
        raise ValueError("log closed")

    w.log = bad_log
    assert compile_through_triton()[0] == "compiled"
    assert w.count == 1


def test_uninstall_restores_triton():
    original = JITFunction._do_compile
    compile_watch.install(None)
    assert JITFunction._do_compile is compile_watch._timed_do_compile
    compile_watch.install(None)  # twice: still one wrapper over Triton's own
    compile_watch.uninstall()
    assert JITFunction._do_compile is original and compile_watch.active() is None


def test_describe_truncates_long_variants():
    text = compile_watch.describe(SCALE, {(i,): i for i in range(200)}, None)
    assert len(text) == 400 and text.endswith("...")
    assert compile_watch.kernel_name(SCALE).endswith("test_compile_watch._scale_kernel")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real compile needs CUDA")
def test_a_real_compile_on_the_gpu_is_logged_and_runs():
    lines: list[str] = []
    compile_watch.install(lines.append)
    try:
        x = torch.zeros(100, device="cuda")
        add_one(x)  # compiled here: the kernel is new to this process
        torch.cuda.synchronize()
        assert torch.equal(x, torch.ones_like(x))
        assert len(lines) == 1 and "_add_one_kernel while serving" in lines[0] and "BLOCK=128" in lines[0]
        add_one(x)  # cached: nothing compiled
        assert len(lines) == 1
    finally:
        compile_watch.uninstall()


@pytest.mark.skipif(not (EMBEDDED_MODEL / "config.json").exists(), reason="embedded model not built")
def test_the_step_log_counts_the_compiles_of_the_step_whose_launch_made_them(tmp_path, monkeypatch, watch):
    """A compile inside one step's forward lands in that step's line (not in the line of the step
    finished next, as a pipelined worker would attribute it by time)."""
    from nsaserve.worker.model_executor import ModelExecutor

    monkeypatch.setenv("NSASERVE_STEP_LOG", str(tmp_path / "steps.jsonl"))
    args = parse_args(["--rank=0", "--tp-size=1", f"--model-path={EMBEDDED_MODEL}", "--num-pages=32", "--page-size=4"])
    ex = ModelExecutor.from_args(args)
    forward = ex.runner.forward_plan
    compiling = {3}

    def forward_that_compiles(plan, patch=None):
        if plan.step in compiling:
            compile_through_triton()
        return forward(plan, patch)

    monkeypatch.setattr(ex.runner, "forward_plan", forward_that_compiles)
    plans = [build_plan(s, 4, [RequestSpec(0, [5, 6, 7], 0, [0, 1])]) for s in (2, 3, 4)]
    first = ex.launch(plans[0], True)
    second = ex.launch(plans[1], True)  # launched before the first is finished, as pipelined
    ex.finish(first)
    ex.finish(second)
    ex.finish(ex.launch(plans[2], True))
    lines = {x["step"]: x for x in map(json.loads, (tmp_path / "steps.jsonl").read_text().splitlines())}
    assert lines[3]["compiles"] == 1 and lines[3]["compile_s"] >= 0
    assert "compiles" not in lines[2] and "compiles" not in lines[4]
    _, logged = watch
    assert len(logged) == 1 and "in step 3 (prefill, 1 requests, 3 tokens)" in logged[0]
