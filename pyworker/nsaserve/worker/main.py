"""Worker process entry: `python -m nsaserve.worker.main --rank R ...` (started by `nsaserve serve`).

Life of a worker: connect to the router's sockets, load the model and the KV pool, say hello,
then run every plan it receives until told to shut down. Anything that stops it from starting, or
a broken tensor-parallel group later (a peer rank died), is reported to the router as one
readable `fatal` line before the process exits non-zero.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading

from ..protocol.arrays import ProtocolError
from ..protocol.late_masks import apply_late_masks, late_rows
from ..protocol.messages import Fatal, Heartbeat, Hello, LateMasks, Plan, StepResult, plan_from_msg, unpack
from ..protocol.validate import validate_plan
from . import compile_watch
from .executor import NullExecutor, StepExecutor
from .inbox import PlanInbox
from .pipeline import DeviceRefs, LaunchedStep, wait_for_plan_or_done
from .prev_step import PrevStep
from .transport import Endpoints, WorkerSockets

HEARTBEAT_S = 1.0


class GroupBroken(Exception):
    """A step failed in a collective: a peer rank is gone, so every later step would fail too."""


def collective_failed(e: BaseException) -> bool:
    # gloo reports a dead peer as a plain RuntimeError naming itself; NCCL as a DistError.
    import torch.distributed as dist

    return isinstance(e, getattr(dist, "DistError", ())) or any(s in str(e) for s in ("gloo", "NCCL"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nsaserve-worker", description="One tensor-parallel rank of nsaserve.")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--tp-size", type=int, required=True)
    p.add_argument("--ipc-dir", help="runtime directory of the router's ipc sockets")
    p.add_argument("--tcp-host", help="router host, when workers connect over tcp")
    p.add_argument("--tcp-base-port", type=int)
    p.add_argument("--dist-init-method", default=None, help="torch.distributed init method (tp > 1)")
    p.add_argument("--model-path", default=None)
    p.add_argument("--model-executor", choices=["model", "null"], default="model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument(
        "--load-format", choices=["safetensors", "random"], default="safetensors", help="see nsaserve serve --help"
    )
    p.add_argument("--attention-backend", default="auto", help="sparse MLA kernels (and the indexer's under --indexer-backend auto): auto, torch, triton")
    p.add_argument("--indexer-backend", default="auto", help="indexer kernels; auto = --attention-backend's")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--moe-backend", default="auto")
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=256)
    p.add_argument("--cuda-graph-bs", type=_sizes, default=None, help="comma-separated batch sizes (overrides max-bs)")
    p.add_argument("--cuda-graph-max-context", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--warmup-tokens",
        type=int,
        default=0,
        help="on CUDA, before the hello: warm-up steps (worker/warmup.py) up to this many prompt tokens; 0: none",
    )
    p.add_argument("--warmup-batch", type=int, default=256, help="largest decode batch of the warm-up")
    dense_help = "dense attention for prompt steps within the top-k (model/dense_prefill.py); auto = on for CUDA"
    p.add_argument("--dense-prefill", choices=("auto", "on", "off"), default="auto", help=dense_help)
    p.add_argument(
        "--worker-pipeline",
        action="store_true",
        help="launch step N+1 before step N's tokens are back (worker/pipeline.py)",
    )
    p.add_argument(
        "--enable-dp-attention",
        action="store_true",
        help="data-parallel attention over the tp ranks (see nsaserve serve --help); page ids span tp pools",
    )
    return p.parse_args(argv)


def _sizes(text: str) -> list[int]:
    sizes = [int(x) for x in text.split(",") if x]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {text!r}")
    return sizes


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM us if `serve` dies, so no worker is ever orphaned."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(1)


def build_executor(args: argparse.Namespace) -> StepExecutor:
    if args.model_executor == "null":
        if os.environ.get("NSASERVE_TEST_SCRIPT"):  # tests only: output forced by a script
            from .scripted_executor import scripted_executor

            return scripted_executor(args)
        executor = NullExecutor(
            vocab_size=model_vocab_size(args.model_path),
            num_pages=args.num_pages or 4096,
            page_size=args.page_size,
            max_context=args.max_context or 4096,
        )
        executor.dp_size = args.tp_size if args.enable_dp_attention else 1
        return executor
    from .model_executor import ModelExecutor

    return ModelExecutor.from_args(args)


def model_vocab_size(model_path: str | None) -> int:
    import json

    if model_path and os.path.exists(os.path.join(model_path, "config.json")):
        with open(os.path.join(model_path, "config.json")) as f:
            return int(json.load(f)["vocab_size"])
    return 32000


# What reading a received plan may raise: the step's requests then fail, not the worker.
PLAN_ERRORS = (ProtocolError, KeyError, ValueError, TypeError)


def receive_plan(data: bytes, executor) -> tuple[Plan, Plan, list[tuple[int, str]]] | None:
    """A received message -> None for a shutdown, else (the plan as received, its runnable part,
    the errors of the requests validation dropped). Raises PLAN_ERRORS for a plan it cannot read."""
    msg = unpack(data)
    if msg["kind"] == "shutdown":
        return None
    full = plan_from_msg(msg)
    # dp_size > 1 (data-parallel attention): page ids span that many pools of num_pages.
    runnable, errors = validate_plan(full, executor.num_pages, executor.vocab_size, getattr(executor, "dp_size", 1))
    return full, runnable, errors


def late_masks_merger(inbox: PlanInbox, vocab_size: int | None, is_rank0: bool):
    """fn(plan) -> (plan with its late rows' masks, errors of the requests whose mask is unusable).
    Rank 0 waits for the step's `masks` message (the router sends it once the step before is
    committed); other ranks sample nothing and take the plan as it is."""

    def merge(plan: Plan) -> tuple[Plan, list[tuple[int, str]]]:
        if not is_rank0 or not len(late_rows(plan)):
            return plan, []
        masks = inbox.masks_for(plan.step)
        if masks is None:
            why = f"the masks of step {plan.step} did not arrive"
            empty = LateMasks(plan.step, plan.req_ids[:0], plan.mask_start[:1], plan.mask_words[:0])
            merged, _ = apply_late_masks(plan, empty, vocab_size)
            return merged, [(int(plan.req_ids[i]), why) for i in late_rows(plan)]
        return apply_late_masks(plan, masks, vocab_size)

    return merge


def without_tokens_of(result: StepResult, errors: list[tuple[int, str]]) -> StepResult:
    """The result with the failed requests' sampled tokens dropped and their errors added."""
    if errors:
        failed = {r for r, _ in errors}
        result.sampled = [e for e in result.sampled if e[0] not in failed]
        result.errors += errors
    return result


def release_histories(executor, plan: Plan) -> None:
    """A plan none of whose requests runs still names requests whose penalty histories can go
    (an executor that keeps them does it in its launch otherwise)."""
    histories = getattr(executor, "histories", None)
    if histories is not None:
        histories.release(plan.released)


def unreadable(e: Exception) -> StepResult:
    """The answer to a plan that could not be read: the router fails every request of the step it
    has in flight (it knows them; we could not read them)."""
    _log(f"dropped an unreadable plan: {e}")
    return StepResult(step=0)


def failed_step(e: Exception, step: int, req_ids) -> list[tuple[int, str]]:
    """The errors of a step whose execution raised: each of its requests fails, the worker goes
    on. A broken collective instead raises GroupBroken (the whole group has to go)."""
    if collective_failed(e):
        raise GroupBroken(f"{type(e).__name__}: {e}".splitlines()[0]) from e
    _log(f"step {step} failed: {type(e).__name__}: {e}")
    return [(int(r), f"worker error: {type(e).__name__}: {e}") for r in req_ids]


def run_plan(
    data: bytes, executor: StepExecutor, is_rank0: bool, prev: PrevStep | None = None, late_masks=None
) -> tuple[StepResult | None, int]:
    """One received message -> the result to send (None for shutdown) and the step it answered.

    `prev` remembers what the last step sampled, for plans that reference it (overlap).
    late_masks(plan): merges the step's late masks (late_masks_merger), waited for before the step
    runs. Raises only `GroupBroken`: a bad plan or a failing step becomes per-request errors in
    the result.
    """
    prev = prev if prev is not None else PrevStep(is_rank0)
    try:
        received = receive_plan(data, executor)
        if received is None:
            return None, -1
        plan, runnable, errors = received
        runnable, bad_refs = prev.resolve(plan, runnable)
    except PLAN_ERRORS as e:
        prev.forget()
        return unreadable(e), 0
    errors += bad_refs
    if not runnable.num_reqs:
        release_histories(executor, plan)
    mask_errors: list[tuple[int, str]] = []
    if late_masks is not None and runnable.num_reqs:
        runnable, mask_errors = late_masks(runnable)
    try:
        result = executor.run(runnable, is_rank0) if runnable.num_reqs else StepResult(step=plan.step)
    except Exception as e:  # a failing step fails its requests, not the worker
        result = StepResult(step=plan.step, errors=failed_step(e, plan.step, runnable.req_ids))
    result = without_tokens_of(result, mask_errors)
    result.step = plan.step
    result.errors = errors + result.errors
    prev.record(plan, result)
    return result, plan.step


def launch_plan(
    data: bytes, executor, is_rank0: bool, refs: DeviceRefs, before_launch=None, after_forward=None, late_masks=None
) -> tuple[str, object, list, int]:
    """The pipelined counterpart of run_plan: one received message -> ("shutdown", None, [], -1),
    ("result", StepResult, [], step) when nothing was launched (an unreadable or empty plan, or a
    launch that failed), or ("launched", LaunchedStep, validation errors, step).
    before_launch(plan): called with the plan about to be launched, before its launch;
    after_forward(): called by the launch once the forward is queued (executor.launch). Neither
    is called when nothing is launched. late_masks(plan): merges the step's late masks, called by
    the launch after after_forward (late_masks_merger). An exception from after_forward is raised here, after the
    launch, not taken for the step's own failure."""
    try:
        received = receive_plan(data, executor)
        if received is None:
            return "shutdown", None, [], -1
        full, runnable, errors = received
        runnable, patch, bad_refs = refs.resolve(full, runnable)
    except PLAN_ERRORS as e:
        refs.forget()
        return "result", unreadable(e), [], 0
    errors += bad_refs
    if not runnable.num_reqs:
        release_histories(executor, full)
        refs.record(full, runnable, None)
        return "result", StepResult(step=full.step, errors=errors), [], full.step
    if before_launch is not None:
        before_launch(runnable)
    hook_errors: list[BaseException] = []

    def hook() -> None:
        try:
            after_forward()
        except BaseException as e:  # noqa: BLE001 - raised again below, outside the launch's own handling
            hook_errors.append(e)

    try:
        step = executor.launch(
            runnable, is_rank0, patch, after_forward=hook if after_forward is not None else None, late_masks=late_masks
        )
    except Exception as e:  # a failing step fails its requests, not the worker
        if hook_errors:
            raise hook_errors[0] from None
        refs.record(full, runnable, None)
        failed = failed_step(e, full.step, runnable.req_ids)
        return "result", StepResult(step=full.step, errors=errors + failed), [], full.step
    if hook_errors:
        raise hook_errors[0]
    refs.record(full, runnable, step)
    return "launched", step, errors, full.step


def finish_step(executor, step: LaunchedStep, errors: list) -> StepResult:
    """A launched step's result, its validation errors first."""
    try:
        result = executor.finish(step)
    except Exception as e:
        result = StepResult(step=step.plan.step, errors=failed_step(e, step.plan.step, step.plan.req_ids))
    result.step = step.plan.step
    result.errors = errors + result.errors
    return result


def serve_pipelined(recv, plan_waiting, send, executor, is_rank0: bool, progress: list[int], late_masks=None) -> None:
    """The step loop of --worker-pipeline (worker/pipeline.py): step N+1 is launched before step
    N's result is built and sent, whenever N+1's plan arrives while N is still running and N+1's
    launch is quick (executor.launch_is_quick). Results go out in step order. Raises GroupBroken
    as run_plan does."""
    refs = DeviceRefs(is_rank0, executor.device)
    pending: tuple[LaunchedStep, list] | None = None
    quick = getattr(executor, "launch_is_quick", lambda plan: True)
    if is_rank0:
        _log("steps pipelined: each launched before the previous one's result is sent")

    def out(result: StepResult) -> None:
        progress[0] = max(progress[0], result.step)
        if is_rank0:
            send(result.encode())

    def finish_first_unless_quick(plan) -> None:
        # A slow launch (on the CPU, one that runs the whole step) would hold N's tokens back
        # for its whole length, and with them the router's next plan.
        if not quick(plan):
            finish_pending()

    def finish_pending() -> None:
        # Called as soon as N+1's forward is queued (before its sampling's host work), so N's
        # result goes out as early as N's device work allows.
        nonlocal pending
        if pending is not None:
            out(finish_step(executor, *pending))
            pending = None

    while True:
        if pending is not None and not wait_for_plan_or_done(plan_waiting, pending[0]):
            finish_pending()  # no plan before N was done: the router waits for N
        kind, what, errors, _ = launch_plan(
            recv(), executor, is_rank0, refs, finish_first_unless_quick, finish_pending, late_masks
        )
        finish_pending()  # when nothing was launched, or the launch failed before its forward
        if kind == "shutdown":
            return
        if kind == "result":
            out(what)
        elif what.can_wait:
            pending = (what, errors)
        else:
            out(finish_step(executor, what, errors))


def _log(message: str) -> None:
    # One write with its newline: unbuffered, print() writes the text and the newline apart, and
    # the router's lines on the same terminal or pipe could land between them.
    sys.stderr.write(f"[nsaserve worker] {message}\n")
    sys.stderr.flush()


def heartbeat_loop(sockets: WorkerSockets, rank: int, progress: list[int], stop: threading.Event) -> None:
    sock = sockets.new_event_socket()
    try:
        while not stop.wait(HEARTBEAT_S):
            sock.send(Heartbeat(rank=rank, step=progress[0]).encode())
    finally:
        sock.close(linger=0)


def share_cpu_threads(args: argparse.Namespace) -> None:
    """On CPU, the tp_size ranks share the machine's cores: each takes cores // tp_size intra-op
    threads (at least 1) instead of all of them. Oversubscribed ranks spin against each other and
    every collective waits for the slowest (TP=8 on 2 cores ran ~10x slower per step). An explicit
    OMP_NUM_THREADS wins."""
    if args.device != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // max(1, args.tp_size)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    die_with_parent()
    share_cpu_threads(args)
    # Ctrl-C reaches the whole process group; `serve` decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if args.ipc_dir:
        endpoints = Endpoints.ipc(args.ipc_dir, args.rank)
    else:
        endpoints = Endpoints.tcp(args.tcp_host, args.tcp_base_port, args.rank)
    sockets = WorkerSockets(endpoints)
    try:
        if args.tp_size > 1 and args.model_executor == "model":
            from .distributed import init_distributed

            init_distributed(args)
        executor = build_executor(args)
    except BaseException as e:  # every startup failure is reported in one line, then exit 1
        line = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
        sockets.send(Fatal(rank=args.rank, message=line).encode())
        sockets.close()
        _log(f"rank {args.rank} failed to start: {line}")
        return 1

    sockets.send(
        Hello(
            rank=args.rank,
            tp_size=args.tp_size,
            pid=os.getpid(),
            model_id=executor.model_id,
            num_pages=executor.num_pages,
            page_size=executor.page_size,
            max_context=executor.max_context,
            vocab_size=executor.vocab_size,
        ).encode()
    )
    if getattr(getattr(executor, "device", None), "type", None) == "cuda":
        # After the warm-up: a kernel variant compiled from here on stalls a serving step.
        compile_watch.install(_log if args.rank == 0 else None)
    progress = [0]
    stop = threading.Event()
    beat = threading.Thread(target=heartbeat_loop, args=(sockets, args.rank, progress, stop), daemon=True)
    beat.start()
    is_rank0 = args.rank == 0
    prev = PrevStep(is_rank0)
    pipelined = args.worker_pipeline and hasattr(executor, "launch")
    inbox = PlanInbox(sockets.recv_plan, sockets.plan_waiting)
    late_masks = late_masks_merger(inbox, executor.vocab_size, is_rank0)
    try:
        if pipelined:
            serve_pipelined(inbox.recv, inbox.waiting, sockets.send, executor, is_rank0, progress, late_masks)
        while not pipelined:
            result, step = run_plan(inbox.recv(), executor, is_rank0, prev, late_masks)
            if result is None:
                break
            progress[0] = max(progress[0], step)
            if is_rank0:
                sockets.send(result.encode())
    except GroupBroken as e:
        # The router fails every open request at once (retryably) instead of per step.
        sockets.send(Fatal(rank=args.rank, message=f"tensor-parallel group broken: {e}").encode())
        _log(f"rank {args.rank} stops: tensor-parallel group broken: {e}")
        return 1
    finally:
        stop.set()
        beat.join(timeout=2 * HEARTBEAT_S)
        sockets.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
