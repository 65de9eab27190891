"""Starting and stopping a real `nsaserve serve` process tree for end-to-end tests."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

# serve's ready line names the port it bound ("--port 0": a free one).
READY_LINE = re.compile(r"nsaserve ready: http://\S+:(\d+)/v1")

# Where the end-to-end tests run the model: cpu by default; NSASERVE_TEST_DEVICE=cuda on a GPU.
DEVICE_FLAG = f"--device={os.environ.get('NSASERVE_TEST_DEVICE', 'cpu')}"


def gpus_short_of(tp: int) -> bool:
    """True when the tests run on CUDA and this machine has fewer than `tp` GPUs."""
    if "cuda" not in DEVICE_FLAG:
        return False
    import torch

    return torch.cuda.device_count() < tp


def descendants(pid: int) -> set[int]:
    """All live descendant pids of `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def worker_pid(server_pid: int, rank: int) -> int:
    """The pid of the worker process of `rank` under `serve` (from its command line)."""
    for pid in descendants(server_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"nsaserve.worker.main" in argv and f"--rank={rank}".encode() in argv:
            return pid
    raise AssertionError(f"no worker of rank {rank} under pid {server_pid}")


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class ServerProcess:
    """`python -m nsaserve serve ...` with its own TMPDIR (so its runtime directory can be
    checked), output captured, stopped with SIGTERM."""

    def __init__(self, *args: str, startup_timeout: float = 240.0):
        # Port 0: serve binds a free port itself and names it in its ready line. (A port
        # picked here and passed in could be taken by another process before serve binds it.)
        self.port: int | None = None
        self.tmp = tempfile.TemporaryDirectory()
        env = dict(os.environ, TMPDIR=self.tmp.name, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "nsaserve", "serve", "--port=0", *args]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.startup_timeout = startup_timeout
        self.has_model_path = any(a.startswith("--model-path") or a.startswith("--model=") for a in args)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> ServerProcess:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited with {self.proc.returncode}:\n{self.output}")
            # "nsaserve ready: http://HOST:PORT/v1 serving ...", searched for anywhere in a line: the
            # workers write to the same pipe, and a line of theirs may still lack its end.
            ready = [m for line in self.lines if (m := READY_LINE.search(line))]
            # Serving the embedded model, serve sends one sample request of its own first.
            if ready and (self.has_model_path or any("sample completion" in line for line in self.lines)):
                self.port = int(ready[0].group(1))
                return self
            time.sleep(0.1)
        raise AssertionError(f"serve not ready after {self.startup_timeout} s:\n{self.output}")

    def wait_exit(self, timeout: float = 60.0) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return code

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def metrics(self) -> dict[str, float]:
        """/metrics as {'name{labels}': value}."""
        status, body = self.get("/metrics")
        assert status == 200, body
        out = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_for_drain(self, timeout: float = 30.0) -> dict[str, float]:
        """/metrics once nothing runs or waits and no request holds a KV page (the engine
        publishes its gauges between steps, so they lag a little)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["nsaserve_requests_running"] == m["nsaserve_requests_waiting"] == m["nsaserve_kv_pages_used"] == 0:
                return m
            assert time.monotonic() < deadline, f"not drained after {timeout} s: {m}"
            time.sleep(0.1)

    def complete(self, prompt: str, max_tokens: int, **fields) -> str:
        """Greedy completion text (raises on any HTTP error); `fields` join the request body."""
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}).encode()
        req = urllib.request.Request(self.base_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["choices"][0]["text"]

    def stop(self) -> int:
        """SIGTERM, then require a clean exit: code 0, no process left, no runtime files left."""
        workers = descendants(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        code = self.wait_exit()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in workers if alive(p)]
        assert not left, f"orphaned processes after SIGTERM: {left}"
        leftovers = list(Path(self.tmp.name).iterdir())
        assert not leftovers, f"runtime files left behind: {leftovers}"
        return code

    def kill_all(self) -> None:
        for p in descendants(self.proc.pid) | {self.proc.pid}:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.tmp.cleanup()
