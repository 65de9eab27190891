"""Optional per-step timing log for benchmarks: with NSASERVE_STEP_LOG=PATH in the environment,
rank 0 appends one JSON line per executed step to PATH.

A line: {"step": the plan's step number, "t": unix time at the end of the step, "mode": "prefill" | "decode" | "mixed",
"reqs": requests, "tokens": tokens run, "ctx": sum of the requests' context lengths after the
step, "sel": sum of min(context, index_topk), "idx": the contexts the indexer scored (ctx, or 0
when no context exceeds index_topk: whole contexts are then selected unscored), "ms": the worker's step time (batch build, forward,
sampling; the sampled tokens reach the host, so the GPU work is included; under --worker-pipeline,
from the previous step's result when the step was launched before it), "graph": whether the
forward replayed a decode CUDA graph, "dense": how many of its requests attended densely
(model/dense_prefill.py; the others of the step attended sparsely),
and on CUDA "mallocs" / "retries": the caching allocator's device allocations and its
flush-and-retry passes (a cudaFree of every cached block, a synchronisation) since the previous
line, so that slow steps can be told apart from steps that grew the memory pool, and on CUDA
the device's own timeline from events recorded around the step's queued work: "gpu_ms" from
its forward (the forward's own input uploads first) to the end of its sampling, "prep_ms" before
that (the device waiting for the launch to queue its forward), and "gap_ms" from the end of the previous step's
work to the start of this one's (the device idled for want of this launch, or ~0 when it was
queued in time); "compiles" / "compile_s" (only when nonzero, after the warm-up): kernel
variants its launch compiled and the seconds they took (worker/compile_watch.py); and the host's side: "host_prep_ms" from the launch's start to its forward being
queued, "host_launch_ms" to the end of the launch (sampling queued), "host_wait_ms" what finishing
the step waited for its results. In a steady pipeline "ms" is about gap + prep + gpu: this tells a slow step
(gpu_ms) from a late host (gap_ms)}.

idx and sel are what a decode step's memory roofline needs (the indexer reads every cached key
it scores, sparse attention reads `sel` latent rows); bench/gpu/glm5_roofline.py turns them into bytes.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from ..model.dense_prefill import dense_requests

ENV = "NSASERVE_STEP_LOG"


class DeviceMarks:
    """Timing events recorded on the step's stream at its launch's start, just before its forward
    is queued, and after its sampling. Recording an event queues nothing that waits, so the
    pipeline's overlap is unchanged; an event completes when the device reaches it."""

    def __init__(self):
        import torch

        self.start, self.forward, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        self.start.record()
        # The host's side of the same moments (perf_counter seconds), so a step log tells host
        # work that keeps the device waiting from the device's own work.
        self.host = {"start": time.perf_counter()}

    def forward_queued(self) -> None:
        self.forward.record()
        self.host["forward"] = time.perf_counter()

    def end_queued(self) -> None:
        self.end.record()
        self.host["end"] = time.perf_counter()


class StepLog:
    def __init__(self, path: str, index_topk: int, dense_prefill: bool = False, device=None):
        """dense_prefill: the model's switch (the step log repeats its per-step choice); device:
        a CUDA device's allocator counters go into every line."""
        self.index_topk = index_topk
        self.dense_prefill = dense_prefill
        self.device = device if device is not None and device.type == "cuda" else None
        self._allocator = self._allocator_counts()
        self._last_end = None  # the previous recorded step's DeviceMarks.end
        self._file = open(path, "a", buffering=1)  # line-buffered: readable while the server runs

    @classmethod
    def from_env(cls, index_topk: int, dense_prefill: bool = False, device=None) -> StepLog | None:
        path = os.environ.get(ENV)
        return cls(path, index_topk, dense_prefill, device) if path else None

    def _allocator_counts(self) -> tuple[int, int]:
        if self.device is None:
            return (0, 0)
        import torch

        stats = torch.cuda.memory_stats(self.device)
        return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)

    def _device_times(self, marks: DeviceMarks) -> dict:
        marks.end.synchronize()  # already done when the step's tokens are back
        times = {"gpu_ms": round(marks.forward.elapsed_time(marks.end), 3),
                 "prep_ms": round(marks.start.elapsed_time(marks.forward), 3)}  # fmt: skip
        if self._last_end is not None:
            times["gap_ms"] = round(self._last_end.elapsed_time(marks.start), 3)
        self._last_end = marks.end  # steps are recorded in launch order
        h = marks.host
        if "forward" in h and "end" in h:
            times["host_prep_ms"] = round((h["forward"] - h["start"]) * 1e3, 3)
            times["host_launch_ms"] = round((h["end"] - h["start"]) * 1e3, 3)
        if "wait" in h:
            times["host_wait_ms"] = round(h["wait"] * 1e3, 3)
        return times

    def record(
        self, plan, step_ms: float, graph: bool = False, marks: DeviceMarks | None = None, compiles=(0, 0.0)
    ) -> None:
        ctx = plan.cached_lens.astype(np.int64) + np.diff(plan.query_start.astype(np.int64))
        line = {
            "step": int(plan.step),
            "t": round(time.time(), 4),
            "mode": plan.mode,
            "reqs": int(plan.num_reqs),
            "tokens": int(plan.num_tokens),
            "ctx": int(ctx.sum()),
            "sel": int(np.minimum(ctx, self.index_topk).sum()),
            "idx": int(ctx.sum()) if len(ctx) and int(ctx.max()) > self.index_topk else 0,
            "ms": round(step_ms, 3),
            "graph": graph,
        }
        qs, seq = plan.query_start.astype(np.int64), ctx
        dense = dense_requests(qs.tolist(), seq.tolist(), self.index_topk) if self.dense_prefill and not graph else []
        line["dense"] = len(dense)
        if self.device is not None:
            now = self._allocator_counts()
            line["mallocs"], line["retries"] = now[0] - self._allocator[0], now[1] - self._allocator[1]
            self._allocator = now
        if marks is not None:
            line.update(self._device_times(marks))
        if compiles[0]:
            line["compiles"], line["compile_s"] = int(compiles[0]), round(compiles[1], 3)
        self._file.write(json.dumps(line) + "\n")
