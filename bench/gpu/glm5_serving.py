"""A `nsaserve serve` process for the GLM-5 sweep: started in its own process group with the
worker step log on, waited for, checked, stopped; and the flags of a random-prompt bench run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class Server:
    """`nsaserve serve` in its own process group, output to a file, worker step log on."""

    def __init__(self, model_path: str, work: Path, tag: str, flags: list[str], log_file, left):
        """flags: serve's flags besides --model-path and --port; log_file gets the output's tail at
        stop(); left() is the run's remaining seconds."""
        self.tag, self.log_file, self.left = tag, log_file, left
        self.port = _free_port()
        self.log_path = work / f"serve-{tag}.log"
        self.step_log = work / f"steps-{tag}.jsonl"
        cmd = [sys.executable, "-m", "nsaserve", "serve", "--model-path", model_path, "--port", str(self.port), *flags]
        self.command = " ".join(cmd)
        env = dict(os.environ, NSASERVE_STEP_LOG=str(self.step_log), PYTHONUNBUFFERED="1")
        self.log = open(self.log_path, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, preexec_fn=_own_group_dies_with_us
        )

    def wait_ready(self, timeout_s: float | None = None) -> float:
        while True:
            text = self.log_path.read_text(errors="replace")
            if "nsaserve ready" in text:
                return time.monotonic() - self.t0
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {text[-3000:]}")
            if self.left() < 5:
                raise TimeoutError("server not ready within the budget")
            if timeout_s is not None and time.monotonic() - self.t0 > timeout_s:
                raise TimeoutError(f"server not ready within {timeout_s:.0f} s: {text[-3000:]}")
            time.sleep(0.5)

    def log_lines(self, needle: str) -> list[str]:
        """The server output's lines containing needle (what the workers said about it)."""
        return [x for x in self.log_path.read_text(errors="replace").splitlines() if needle in x]

    def steps(self) -> list[dict]:
        if not self.step_log.exists():
            return []
        return [json.loads(line) for line in self.step_log.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group this driver created for it
                self.proc.wait()
        self.log.close()
        tail = self.log_path.read_text(errors="replace").splitlines()
        self.log_file.write(f"--- serve-{self.tag}.log (last 60 lines) ---\n" + "\n".join(tail[-60:]) + "\n")


def gpu_memory() -> str | None:
    try:
        q = ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"]
        return subprocess.run(q, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def finite_logits_check(port: int, vocab: int, prompt_len: int = 256) -> dict:
    """Greedy 4 tokens with echo + logprobs: every prompt position's and every generated token's
    logprobs come back from the full stack; random weights must keep them finite (no NaN/inf)."""
    import math
    import random
    import urllib.request

    base = f"http://127.0.0.1:{port}"
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
        model = json.load(r)["data"][0]["id"]
    prompt = [random.Random(0).randrange(vocab) for _ in range(prompt_len)]
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 5, "echo": True}
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        lp = json.load(r)["choices"][0]["logprobs"]
    values = [v for v in lp["token_logprobs"] if v is not None]
    values += [v for top in lp["top_logprobs"] if top for v in top.values()]
    finite = all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)
    return {"values": len(values), "finite": finite, "min": min(values), "max": max(values)}


def _own_group_dies_with_us() -> None:
    """In the server's child process: its own process group (so it can be killed as one), and a
    SIGTERM from the kernel if this driver dies first (no server outlives a killed run)."""
    import ctypes

    os.setsid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def random_flags(concurrency: int, prompts: int, in_len: int, out_len: int, ratio: float) -> list[str]:
    return ["--random-input-len", str(in_len), "--random-output-len", str(out_len), "--random-range-ratio", str(ratio),
            "--max-concurrency", str(concurrency), "--num-prompts", str(prompts)]  # fmt: skip
