"""The eager forward never makes the host wait for the device: no .item() / bool(tensor) /
.tolist() / .cpu() of device data and no op whose output size depends on device data (nonzero,
unique, boolean-mask indexing, repeat_interleave without output_size), in prefill, mixed and decode
steps, with every kernel backend that runs here.

On CPU nothing waits, but the same calls happen, so they are counted: a TorchDispatchMode sees every
aten op the forward runs (item() and bool() reach it as _local_scalar_dense, .cpu() of a device
tensor as a copy across devices), and the few Tensor methods that read memory without an aten op
(tolist, numpy) are wrapped for the duration. The torch "moe_experts" reference is the one backend
that synchronises by design (it asks which experts got tokens); the counter must catch it.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
from model_helpers import VOCAB, Session, make_checkpoint, quantize_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from nsaserve.model.runner import ModelRunner

aten = torch.ops.aten
GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if GPU else "cpu")

# Ops that read device data on the host, or size their output from it.
_SYNC_OPS = {
    aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
    aten.nonzero.default, aten.masked_select.default,
    aten._unique.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default,
}  # fmt: skip
_HOST_METHODS = ("tolist", "numpy", "item")


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class HostSyncCounter(TorchDispatchMode):
    """Counts host-synchronising ops by name (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._saved = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__)
        if func in _SYNC_OPS:
            self.counts[name] += 1
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and _bool_index(args):
            self.counts[name + "(bool mask)"] += 1
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.counts["repeat_interleave(no output_size)"] += 1
        elif func in (aten._to_copy.default, aten.copy_.default):
            src = args[1] if func is aten.copy_.default else args[0]
            dst_dev = args[0].device if func is aten.copy_.default else kwargs.get("device")
            if dst_dev is not None and torch.device(dst_dev).type == "cpu" and src.device.type != "cpu":
                self.counts["copy to host"] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        for m in _HOST_METHODS:
            orig = self._saved[m] = getattr(torch.Tensor, m)
            setattr(torch.Tensor, m, self._wrap(m, orig))
        return super().__enter__()

    def __exit__(self, *exc):
        for m, orig in self._saved.items():
            setattr(torch.Tensor, m, orig)
        return super().__exit__(*exc)

    def _wrap(self, name, orig):
        counts = self.counts

        def method(t, *a, **kw):
            caller = sys._getframe(1).f_code.co_filename
            if "triton" not in caller.split("nsaserve")[-1]:  # not the interpreter's own bookkeeping
                counts[f"Tensor.{name}"] += 1
            return orig(t, *a, **kw)

        return method


def _steps(runner, seed=0):
    """Prefill of two prompts, a mixed step (a new prompt + both decoding), a decode step:
    -> {mode: Counter of host-synchronising ops in that forward}."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (21, 6, 9)]
    session = Session(runner, seed=seed)
    from nsaserve.worker.batch import build_forward_batch

    work = [
        [(0, prompts[0]), (1, prompts[1])],
        [(0, [3]), (1, [5]), (2, prompts[2])],
        [(0, [7]), (1, [2]), (2, [4])],
    ]
    out = {}
    for step in work:
        plan = session.plan(step, all_logits=False)
        batch = build_forward_batch(plan, runner.device)  # the worker builds it before the forward
        with HostSyncCounter() as counter:
            logits = runner.forward(batch)
        assert torch.isfinite(logits).all()
        for rid, toks in step:
            session.reqs[rid].cached += len(toks)
        out[plan.mode] = counter.counts
    assert set(out) == {"prefill", "mixed", "decode"}, list(out)
    return out


def _runner(path, dtype, kv, backends):
    r = ModelRunner(path, device=DEV, dtype=dtype, kv_cache_dtype=kv, num_pages=64, page_size=4, show_progress=False)
    for kind, name in backends.items():
        r.set_backend(kind, name)
    return r


TORCH = {"moe_experts": "torch_dense"}
TRITON = {k: "triton" for k in ("attention", "indexer", "rmsnorm", "rope", "kv_store", "index_key_store", "moe_route")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("host_syncs")
    # hidden and moe_intermediate 128: the NVFP4 MoE kernels' smallest K block; rope dim 16: the
    # sparse MLA kernel's smallest MMA side.
    make_checkpoint("glm_moe_dsa", str(root / "float"), seed=2, hidden_size=128, moe_intermediate_size=128,
                    qk_rope_head_dim=16)  # fmt: skip
    quantize_checkpoint(str(root / "float"), str(root / "nvfp4"), "nvfp4", "experts")
    return {"float": str(root / "float"), "nvfp4": str(root / "nvfp4")}


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("weights", ["float", "nvfp4"])
def test_torch_backends_do_not_sync(checkpoints, weights, kv):
    for mode, counts in _steps(_runner(checkpoints[weights], torch.float32, kv, TORCH)).items():
        assert not counts, f"{mode}: {dict(counts)}"


def test_counter_sees_the_synchronising_reference(checkpoints):
    """The torch "moe_experts" reference asks for the experts that got tokens (unique, nonzero,
    tolist): the counter must see it, or the other tests prove nothing."""
    for weights in ("float", "nvfp4"):
        counts = _steps(_runner(checkpoints[weights], torch.float32, "auto", {"moe_experts": "torch"}))
        for mode, c in counts.items():
            assert c["_unique2"] + c["unique_dim"] + c["_unique"] >= 1, (weights, mode, dict(c))


def test_triton_backends_do_not_sync(checkpoints):
    pytest.importorskip("triton")
    backends = {**TRITON, "moe_experts": "triton"}
    dtype = torch.bfloat16 if GPU else torch.float32
    for mode, counts in _steps(_runner(checkpoints["nvfp4"], dtype, "fp8_e4m3", backends)).items():
        assert not counts, f"{mode}: {dict(counts)}"


def _two_steps(r, seed=1):
    session = Session(r, seed=seed)
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    return torch.stack(session.step([(0, prompt)]) + session.step([(0, [1])]))


def test_old_host_path_matches(checkpoints):
    """The per-call lookup path (model.HOST_PATH_ENV=lookup, kept for measuring) gives the same
    logits as the resolved one."""
    r = _runner(checkpoints["nvfp4"], torch.float32, "fp8_e4m3", TORCH)
    logits = {}
    for resolved in (True, False):
        r.model.resolve_kernels = resolved
        logits[resolved] = _two_steps(r)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)
