"""Pipelined steps (--worker-pipeline): the worker queues step N+1's device work before it waits
for step N's tokens, so the GPU never waits for the host between decode steps.

Without it a worker's step is: build the step's tensors, queue the forward and the sampler, wait
for the tokens, send the result, receive the next plan, and only then queue the next forward. The
GPU idles for all the host work between two forwards (on the H200 at GLM-5 shapes, 1-2 ms of a
15-20 ms decode step). With the router's overlap schedule the next plan is usually already waiting
while step N runs, but its requests' input tokens are step N's samples (`input_prev_row`), which
only the device has yet. Here they stay on the device:

1. launch(N+1) with an InputPatch: the referenced rows' tokens are gathered from step N's sampled
   tokens on the device (a broadcast from rank 0 first, in stream order, under tensor
   parallelism); N+1's forward is queued behind N's sampler;
2. finish(N) as soon as N+1's forward is queued, before N+1's sampling is built and queued:
   wait for N's tokens (copied to pinned memory at launch) and send N's result, so the router
   plans N+2 while the device runs N+1's forward and the host builds N+1's sampling;
3. while N+1 runs, receive N+2 (or, when none comes before N+1 is done, send N+1's result and
   wait for the router).

What the router sees is unchanged: one result per step, in order. A reference is checked on the
host as before (it must name a row of the previous step that samples for the same request); a bad
one fails its request alone. Steps that return prompt logprobs are finished before the next launch
(their logits are read after it). Under data-parallel attention each rank patches the inputs of its own
requests (InputPatch.for_requests). Not used by executors without launch/finish (the null executor).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..protocol.messages import Plan
from .batch import InputPatch
from .host_to_device import upload
from .prev_step import drop_bad_refs, group_size, same_request_rows


@dataclass
class LaunchedStep:
    """A step whose device work is queued (ModelExecutor.launch) and whose result is not built yet."""

    plan: Plan  # the runnable plan
    is_rank0: bool
    t0: float
    graph: bool
    sb: object | None  # SamplingBatch of rank 0's sampling rows
    prompt_rows: list = field(default_factory=list)  # prompt-logprob rows (batch.prompt_logprob_rows)
    on_cpu: bool = False  # the step ran on the CPU: launch() returned after all of its work
    failed: list = field(default_factory=list)  # (request, why) failed at launch; their tokens are dropped
    logits: torch.Tensor | None = None  # kept only for prompt logprobs
    sampled: object | None = None  # SampleOutput on the device (the next step's input patch reads its tokens)
    host: object | None = None  # on CUDA, its pinned host copy (sampling_results.copy_to_host)
    copied: object | None = None  # torch.cuda.Event after the copy to the host (sampling_results.copy_to_host)
    marks: object | None = None  # step_log.DeviceMarks, when a step log is kept on CUDA
    compiles: tuple[int, float] = (0, 0.0)  # kernel variants compiled by its launch, seconds (compile_watch)

    @property
    def can_wait(self) -> bool:
        """Whether finishing it later, after the next launch, costs nothing: only rank 0 waits for
        anything, and a step whose outputs were copied to the host at launch waits for one event
        (a step with prompt logprobs reads its logits after the launch, which would wait for the
        next step's work too). On the CPU every launch has already run, so any step can."""
        return not self.is_rank0 or self.copied is not None or self.on_cpu

    def done(self) -> bool:
        return self.copied is None or self.copied.query()


def tokens_by_row(plan: Plan, tokens: torch.Tensor) -> torch.Tensor:
    """The sampled tokens (one per sampling row, in plan order) at their requests' rows, -1 elsewhere."""
    rows = upload(np.flatnonzero(plan.sample), tokens.device, np.int64)
    out = torch.full((plan.num_reqs,), -1, dtype=torch.int64, device=tokens.device)
    return out.index_copy_(0, rows, tokens.to(torch.int64))


@dataclass
class _Previous:
    step: int
    req_ids: np.ndarray  # of the plan as received
    run_row: np.ndarray  # int64: each received row's row in the runnable plan, -1 if dropped
    samples: np.ndarray  # bool, per runnable row: it samples (and its launch did not fail)
    row_tokens: torch.Tensor | None  # rank 0: tokens by runnable row, on the device


class DeviceRefs:
    """The previous step's sampled tokens, kept on the device, and the next plan's references to
    them turned into an InputPatch (the host-side counterpart is prev_step.PrevStep)."""

    def __init__(self, is_rank0: bool, device: torch.device, broadcast=None):
        self.is_rank0 = is_rank0
        self.device = device
        self.last: _Previous | None = None
        self.broadcast = broadcast  # tests pass their own; else torch.distributed when a group exists

    def forget(self) -> None:
        self.last = None

    def record(self, full: Plan, runnable: Plan, step: LaunchedStep | None) -> None:
        """After a launch (step None: it failed, so nothing of it may be referenced)."""
        if runnable.num_reqs == full.num_reqs:  # nothing dropped (validation keeps the order)
            run_row = np.arange(full.num_reqs, dtype=np.int64)
        else:
            index = {int(r): i for i, r in enumerate(runnable.req_ids)}
            run_row = np.array([index.get(int(r), -1) for r in full.req_ids], dtype=np.int64)
        samples = runnable.sample.astype(bool) if step is not None else np.zeros(runnable.num_reqs, dtype=bool)
        sampled = step.sampled if step is not None else None
        tokens = tokens_by_row(runnable, sampled.tokens) if sampled is not None else None
        self.last = _Previous(full.step, np.asarray(full.req_ids), run_row, samples, tokens)

    def _tokens(self, last: _Previous) -> torch.Tensor:
        """Rank 0's tokens by runnable row, on every rank (collective when there is a group)."""
        n = len(last.samples)
        mine = last.row_tokens
        if mine is None:
            mine = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        broadcast = self.broadcast
        if broadcast is None and group_size() > 1:
            broadcast = _broadcast
        return mine if broadcast is None else broadcast(mine, n, self.is_rank0, self.device)

    def resolve(self, full: Plan, runnable: Plan) -> tuple[Plan, InputPatch | None, list[tuple[int, str]]]:
        """`runnable` without its bad references, the patch for its good ones, and the errors.
        Whether to fetch the tokens is decided on `full` (the plan as received), the same on
        every rank, so every rank joins the broadcast."""
        if not (full.input_prev_row >= 0).any():
            return runnable, None, []
        last = self.last
        usable = last is not None and last.step + 1 == full.step
        tokens = self._tokens(last) if usable else None
        refs = np.flatnonzero(runnable.input_prev_row >= 0)
        if len(refs) == 0:
            return runnable, None, []
        ok = np.zeros(len(refs), dtype=bool)
        run_rows = np.zeros(len(refs), dtype=np.int64)
        if usable:
            r, same = same_request_rows(last.req_ids, runnable, refs)
            run_rows = np.where(same, last.run_row[r], -1) if len(last.req_ids) else np.full(len(refs), -1)
            ok = run_rows >= 0
            ok[ok] = last.samples[run_rows[ok]]
        plan, errors = drop_bad_refs(runnable, refs, ok)
        if not ok.any():
            return plan, None, errors
        # The kept references keep their order through select: the k-th reference of `plan`.
        token_index = plan.query_start[np.flatnonzero(plan.input_prev_row >= 0)].astype(np.int64)
        take = upload(run_rows[ok], tokens.device)
        return plan, InputPatch(token_index, tokens.index_select(0, take)), errors


def _broadcast(mine: torch.Tensor, n: int, is_rank0: bool, device: torch.device) -> torch.Tensor:
    """Rank 0's [n] tokens on every rank: in stream order on NCCL (no host synchronisation)."""
    import torch.distributed as dist

    where = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = mine.to(where) if is_rank0 else torch.empty(n, dtype=torch.int64, device=where)
    dist.broadcast(t, src=0)
    return t.to(device)


def wait_for_plan_or_done(plan_waiting, step: LaunchedStep, poll_s: float = 50e-6) -> bool:
    """While `step` runs: True as soon as a plan is waiting, False once the step is done and none
    is (then its result should go out before the router can plan further)."""
    while True:
        if plan_waiting():
            return True
        if step.done():
            return plan_waiting()
        time.sleep(poll_s)


__all__ = ["LaunchedStep", "DeviceRefs", "tokens_by_row", "wait_for_plan_or_done"]
