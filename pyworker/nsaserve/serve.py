"""`nsaserve serve`: the process supervisor.

It binds the router's sockets, starts `--tp` worker processes, waits for every hello, then lets
the router (Rust, in this process, on its own threads) serve HTTP while this thread watches the
workers. When a worker dies or goes silent, open requests fail, HTTP answers 503, and (unless
--no-restart-workers) the whole group is killed and started again; the router serves again with
an empty KV pool once every new worker said hello. Ctrl-C or SIGTERM stops everything: the
router first (open requests end cleanly), then the workers (asked, then terminated, then
killed), then the runtime directory is removed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .serve_args import http_limits

EMBEDDED_MODEL = Path(__file__).parent / "embedded_model"
POLL_S = 0.2
# --max-worker-restarts counts the restarts within this window.
RESTART_WINDOW_S = 600.0
# Seconds the rest of a failed worker group gets to exit on SIGTERM before SIGKILL.
KILL_GRACE_S = 2.0


class ServeError(RuntimeError):
    """A failure `serve` reports in one line before exiting non-zero."""


@dataclass
class WorkerProcess:
    rank: int
    proc: subprocess.Popen

    def exit_reason(self) -> str | None:
        code = self.proc.poll()
        if code is None:
            return None
        if code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exited with code {code}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def worker_command(args, rank: int, runtime_dir: str | None, dist_init: str | None, model_path: str, device: str) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "nsaserve.worker.main",
        f"--rank={rank}",
        f"--tp-size={args.tp}",
        f"--model-path={model_path}",
        f"--model-executor={args.model_executor}",
        f"--device={device}",
        f"--dtype={args.dtype}",
        f"--kv-cache-dtype={args.kv_cache_dtype}",
        f"--load-format={args.load_format}",
        f"--attention-backend={args.attention_backend}",
        f"--indexer-backend={args.indexer_backend}",
        f"--page-size={args.page_size}",
        f"--moe-backend={args.moe_backend}",
        f"--dense-prefill={args.dense_prefill}",
        f"--mem-fraction-static={args.mem_fraction_static}",
        f"--seed={args.random_seed}",
    ]
    cmd.append(f"--cuda-graph-max-bs={args.cuda_graph_max_bs}")
    if args.cuda_graph_bs:
        cmd.append("--cuda-graph-bs=" + ",".join(str(b) for b in args.cuda_graph_bs))
    if args.cuda_graph_max_context:
        cmd.append(f"--cuda-graph-max-context={args.cuda_graph_max_context}")
    if args.disable_cuda_graph:
        cmd.append("--disable-cuda-graph")
    if args.enable_dp_attention:
        cmd.append("--enable-dp-attention")
    if not args.disable_worker_pipeline:
        cmd.append("--worker-pipeline")
    if not args.skip_server_warmup:
        # The largest steps the router will plan: prompt tokens per step, requests at once.
        cmd += [f"--warmup-tokens={args.max_prefill_tokens}", f"--warmup-batch={args.max_running_requests}"]
    if runtime_dir:
        cmd.append(f"--ipc-dir={runtime_dir}")
    else:
        cmd += [f"--tcp-host={args.worker_host}", f"--tcp-base-port={args.worker_base_port}"]
    if dist_init:
        cmd.append(f"--dist-init-method={dist_init}")
    total = args.max_total_tokens or (65536 if device == "cpu" else None)
    if total:
        cmd.append(f"--num-pages={max(1, total // args.page_size)}")
    return cmd


def router_config(args, runtime_dir: str | None, model_path: str) -> dict:
    chunk = None if args.chunked_prefill_size is None or args.chunked_prefill_size <= 0 else args.chunked_prefill_size
    return {
        "tp": args.tp,
        "endpoints": {"ipc_dir": runtime_dir} if runtime_dir else {"tcp_host": args.worker_host, "tcp_base_port": args.worker_base_port},
        "model_path": model_path,
        "served_model_name": args.served_model_name or ("nsaserve-zen" if Path(model_path) == EMBEDDED_MODEL else Path(model_path).name),
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key,
        "max_running_requests": args.max_running_requests,
        "max_queued_requests": args.max_queued_requests,
        "max_prefill_tokens": args.max_prefill_tokens,
        "chunked_prefill_size": chunk,
        "disable_radix_cache": args.disable_radix_cache,
        "disable_overlap_schedule": args.disable_overlap_schedule,
        "enable_dp_attention": args.enable_dp_attention,
        "enable_priority_scheduling": args.enable_priority_scheduling,
        "schedule_low_priority_values_first": args.schedule_low_priority_values_first,
        "priority_scheduling_preemption_threshold": args.priority_scheduling_preemption_threshold,
        "heartbeat_timeout_s": args.heartbeat_timeout,
        "log_level": args.log_level,
        "reasoning_parser": args.reasoning_parser,
        "tool_call_parser": args.tool_call_parser,
        "sampling_defaults": args.sampling_defaults,
        **http_limits(args),
    }


class Supervisor:
    def __init__(self, args):
        self.args = args
        self.model_path = str(Path(args.model_path).resolve()) if args.model_path else str(EMBEDDED_MODEL)
        self.device = args.device or default_device()
        self.runtime_dir: str | None = None
        self.workers: list[WorkerProcess] = []
        self.router = None
        # When each worker restart of the last RESTART_WINDOW_S began (monotonic seconds).
        self.restarts: list[float] = []

    def start(self) -> None:
        if not 0 <= self.args.priority_scheduling_preemption_threshold < 2**32:
            raise ServeError(
                f"--priority-scheduling-preemption-threshold must be a non-negative integer, got {self.args.priority_scheduling_preemption_threshold}"
            )
        if self.args.enable_dp_attention and self.args.tp < 2:
            raise ServeError(f"--enable-dp-attention needs --tp >= 2, got --tp {self.args.tp}")
        from ._router import Router

        if not os.path.exists(os.path.join(self.model_path, "config.json")):
            raise ServeError(f"model path {self.model_path} has no config.json")
        if self.device == "cuda" and self.args.model_executor == "model":
            import torch

            found = torch.cuda.device_count()
            if found < self.args.tp:
                # NCCL refuses two ranks on one GPU with an opaque error; say it plainly first.
                raise ServeError(f"--tp {self.args.tp} needs {self.args.tp} GPUs, this machine has {found}")
        if self.args.worker_transport == "ipc":
            # mkdtemp makes the directory 0700: only this user can reach the worker sockets.
            self.runtime_dir = tempfile.mkdtemp(prefix="nsaserve-")
        try:
            self.router = Router(json.dumps(router_config(self.args, self.runtime_dir, self.model_path)))
        except RuntimeError as e:
            # Refused before any worker starts (e.g. an invalid generation_config.json): one line.
            raise ServeError(str(e)) from None
        self.spawn_workers()
        self.info = self.wait_ready(self.router.poll_ready)

    def spawn_workers(self) -> None:
        # A fresh rendezvous port each time: a restarted group must not meet the old one's.
        dist_init = f"tcp://127.0.0.1:{free_port()}" if self.args.tp > 1 else None
        self.workers = []
        for rank in range(self.args.tp):
            cmd = worker_command(self.args, rank, self.runtime_dir, dist_init, self.model_path, self.device)
            self.workers.append(WorkerProcess(rank, subprocess.Popen(cmd, stdin=subprocess.DEVNULL)))

    def dead_worker(self) -> tuple[int, str] | None:
        for w in self.workers:
            reason = w.exit_reason()
            if reason is not None:
                return w.rank, reason
        return None

    def wait_ready(self, poll) -> dict:
        """Polls (`Router.poll_ready` or `poll_restarted`) until every worker said hello."""
        deadline = time.monotonic() + self.args.startup_timeout
        while True:
            try:
                info = poll(POLL_S)
            except RuntimeError as e:
                raise ServeError(str(e)) from None
            if info is not None:
                return json.loads(info)
            dead = self.dead_worker()
            if dead is not None:
                # Give its fatal line a moment to arrive: it is more useful than an exit code.
                try:
                    info = poll(1.0)
                except RuntimeError as e:
                    raise ServeError(str(e)) from None
                raise ServeError(f"worker rank {dead[0]} {dead[1]} before it was ready")
            if time.monotonic() > deadline:
                raise ServeError(f"workers were not ready after {self.args.startup_timeout:.0f} s")

    def _kv_pages_said(self) -> str:
        """The KV pool for the ready line: with data-parallel attention each rank has its own
        pool, and the router's page space is all of them."""
        pages = self.info["num_pages"]
        if getattr(self.args, "enable_dp_attention", False):
            n = self.info["tp_size"]
            return f"data-parallel attention, {n} x {pages} = {n * pages} KV pages"
        return f"{pages} KV pages"

    def serve_forever(self) -> int:
        self.router.start()
        a, i = self.args, self.info
        port = self.router.http_port  # the one bound: `--port 0` picks a free one
        # One write with its newline (print() writes them apart when unbuffered): scripts wait
        # for this line, and the workers' own lines share the terminal or pipe.
        sys.stdout.write(
            f"nsaserve ready: http://{a.host}:{port}/v1 serving {i['model_id']} as "
            f"{router_config(a, self.runtime_dir, self.model_path)['served_model_name']} "
            f"(tp {i['tp_size']}, {self.device}, {self._kv_pages_said()} of {i['page_size']} tokens)\n"
        )
        sys.stdout.flush()
        if Path(self.model_path) == EMBEDDED_MODEL:
            # On its own thread: a worker that dies meanwhile is noticed at once, not after it.
            threading.Thread(target=show_sample_completion, args=(a.host, port, a.api_key), daemon=True).start()
        # Until signalled. A dead or silent worker fails every open request and turns /health
        # red (the router answers 503 from then on); the HTTP server stays up so load balancers
        # see it. Then the worker group is restarted, unless that is off or keeps failing.
        given_up = False
        while True:
            time.sleep(POLL_S)
            reason = None if given_up else self.group_failure()
            if reason is None:
                continue
            if not a.restart_workers:
                print(f"nsaserve: error: {reason}; answering 503 until restarted", file=sys.stderr, flush=True)
                given_up = True
            else:
                given_up = not self.recover(reason)

    def group_failure(self) -> str | None:
        """Why the worker group cannot serve, or None while it can."""
        dead = self.dead_worker()
        if dead is not None:
            # The engine may be waiting on that rank: fail its requests now, not at the
            # heartbeat limit.
            self.router.worker_exited(dead[0], dead[1])
        elif self.router.is_running():
            return None
        return self.router.exit_reason() or (f"worker rank {dead[0]} {dead[1]}" if dead else "the engine stopped")

    def recover(self, reason: str) -> bool:
        """Restarts the worker group until it serves again; False once the restart budget
        (--max-worker-restarts within RESTART_WINDOW_S) is spent, so a model that crashes at
        once does not spin forever."""
        while True:
            now = time.monotonic()
            self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S]
            if len(self.restarts) >= self.args.max_worker_restarts:
                print(
                    f"nsaserve: error: {reason}; {len(self.restarts)} worker restarts in "
                    f"{RESTART_WINDOW_S / 60:.0f} minutes, not restarting again: answering 503 until restarted",
                    file=sys.stderr,
                    flush=True,
                )
                self.stop_workers()
                return False
            self.restarts.append(now)
            print(f"nsaserve: error: {reason}; restarting the workers (answering 503 meanwhile)", file=sys.stderr, flush=True)
            try:
                self.stop_workers()
                self.router.begin_restart()
                self.spawn_workers()
                self.info = self.wait_ready(self.router.poll_restarted)
            except (ServeError, RuntimeError) as e:
                reason = f"the restart failed: {e}"
                continue
            print(
                f"nsaserve: workers restarted in {time.monotonic() - now:.1f} s; serving again "
                f"({self.info['num_pages']} KV pages)",
                file=sys.stderr,
                flush=True,
            )
            return True

    def stop_workers(self) -> None:
        """Ends the current worker group at once: SIGTERM, then SIGKILL after a grace period.
        (A surviving rank may be stuck in a collective with the dead one: no polite exit.)"""
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.terminate()
        deadline = time.monotonic() + KILL_GRACE_S
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()

    def stop(self) -> None:
        if self.router is not None:
            self.router.shutdown()  # fails open requests, tells workers to exit
        for w in self.workers:
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                w.proc.terminate()
        for w in self.workers:
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        if self.runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)


def show_sample_completion(host: str, port: int, api_key: str | None) -> None:
    """A newcomer's first look: one greedy completion from the embedded model, over HTTP."""
    import urllib.request

    prompt = "Beautiful is better than"
    body = json.dumps({"prompt": prompt, "max_tokens": 24, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/v1/completions", data=body)
    req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            text = json.loads(r.read())["choices"][0]["text"]
        print(f"sample completion: {prompt!r} -> {text!r}", flush=True)
    except Exception as e:  # informational only; serving goes on
        print(f"nsaserve: sample completion failed: {e}", file=sys.stderr, flush=True)


def raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def serve(args) -> int:
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    sup = Supervisor(args)
    try:
        sup.start()
        return sup.serve_forever()
    except KeyboardInterrupt:
        print("nsaserve: shutting down", file=sys.stderr, flush=True)
        return 0
    except ServeError as e:
        print(f"nsaserve: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sup.stop()
