"""Soak: mixed load on one `nsaserve serve` for a long time; memory, latency and the KV pool must
not drift.

Load: `--concurrency` client threads, each sending one request after another, every one drawn
at random: /v1/completions or /v1/chat/completions, streaming or not, prompt and output lengths,
greedy or sampled, and about one in ten abandoned (a stream closed after a few chunks, or a
request whose connection closes before the answer).

Every `--interval-s` it samples the resident memory of the server process tree (serve, which
hosts the router, and its workers, from /proc) and the latency of the requests that finished in
that window: milliseconds per output token (end to end / tokens) and time to first token of
streams. The first `--warmup-s` are warm-up; the baseline is the first window after it.

Checks (all must hold; the process exits 1 otherwise):
- resident memory stays within `--rss-tolerance` (10 %) of the baseline in every later window;
- latency does not drift: the median latency of the probe (a fixed 16-token completion sent
  over and over by one more client) in the last third of the windows is within
  `--latency-tolerance` (1.5x) of that of the first third;
- no request fails (abandoned ones are not failures);
- after the load stops and the server drains, every KV page is free again (/metrics:
  nsaserve_kv_pages_used 0), and SIGTERM stops the server with exit code 0.

    python bench/soak.py --duration-s 1800 --json bench/results/soak.json --md bench/results/soak.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import json
import os
import platform
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# The latency probe: one more client sending this same request over and over. With random
# lengths, per-request latency says little; the probe's, under the same mixed load, is comparable
# from one window to the next.
PROBE_PATH = "/v1/completions"
PROBE_BODY = {"prompt": "Beautiful is better than", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
WORDS = (
    "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex. "
    "Complex is better than complicated. Flat is better than nested. Sparse is better than dense. "
    "Readability counts. Special cases aren't special enough to break the rules."
).split()


# ------------------------------------------------------------------ the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [pid], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass  # exited between listing and reading
    return total


class Server:
    def __init__(self, flags: list[str], startup_timeout: float = 300.0):
        self.port = free_port()
        cmd = [sys.executable, "-m", "nsaserve", "serve", f"--port={self.port}", *flags]
        self.command = " ".join(cmd[1:])
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + startup_timeout
        while not any("nsaserve ready" in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("server did not start:\n" + "\n".join(self.lines[-30:]))
            time.sleep(0.2)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def metrics(self) -> dict[str, float]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.split()
                out[name] = float(value)
        return out

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def kill(self) -> None:
        for pid in reversed(process_tree(self.proc.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


# ------------------------------------------------------------------ the load


@dataclass
class Done:
    end: float
    ok: bool
    probe_ms: float | None = None
    abandoned: bool = False
    ms_per_token: float | None = None
    ttft_ms: float | None = None
    error: str = ""


@dataclass
class Load:
    port: int
    seed: int
    stop: threading.Event = field(default_factory=threading.Event)
    done: list[Done] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def body(self, rng: random.Random) -> tuple[str, dict, bool, int | None]:
        """(path, body, stream, abandon after this many chunks or None)."""
        chat = rng.random() < 0.5
        stream = rng.random() < 0.6
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120)))
        body = {"max_tokens": rng.randint(1, 96), "temperature": rng.choice([0.0, 0.0, 0.8])}
        if chat:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
        else:
            path, body["prompt"] = "/v1/completions", text
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        abandon = None
        if rng.random() < 0.1:
            abandon = rng.randint(1, 8) if stream else 0
        return path, body, stream, abandon

    def one(self, rng: random.Random, probe: bool = False) -> Done:
        path, body, stream, abandon = (PROBE_PATH, PROBE_BODY, False, None) if probe else self.body(rng)
        t0 = time.perf_counter()
        # Generous: on a loaded machine a long non-streaming answer takes minutes; a request
        # that fails is one the server failed, not one the client gave up on.
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=900)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            if abandon == 0:  # gone before the answer
                conn.close()
                return Done(time.time(), ok=True, abandoned=True)
            resp = conn.getresponse()
            if resp.status != 200:
                return Done(time.time(), ok=False, error=f"HTTP {resp.status}: {resp.read()[:200]!r}")
            if not stream:
                usage = json.loads(resp.read())["usage"]
                ms = (time.perf_counter() - t0) * 1e3
                return Done(
                    time.time(),
                    ok=True,
                    ms_per_token=ms / max(1, usage["completion_tokens"]),
                    probe_ms=ms if probe else None,
                )
            chunks, ttft, tokens, finished = 0, None, 0, False
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    finished = True
                    break
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event.get("choices") and ttft is None:
                    ttft = (time.perf_counter() - t0) * 1e3
                chunks += 1
                if abandon is not None and chunks >= abandon:
                    conn.close()
                    return Done(time.time(), ok=True, abandoned=True)
            if not finished:
                return Done(time.time(), ok=False, error="stream ended without [DONE]")
            ms = (time.perf_counter() - t0) * 1e3
            return Done(time.time(), ok=True, ms_per_token=ms / max(1, tokens), ttft_ms=ttft)
        except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
            return Done(time.time(), ok=False, error=f"{type(e).__name__}: {e}")
        finally:
            conn.close()

    def client(self, index: int, probe: bool = False) -> None:
        rng = random.Random(self.seed * 1000 + index)
        while not self.stop.is_set():
            d = self.one(rng, probe)
            with self.lock:
                self.done.append(d)

    def window(self, start: float, end: float) -> list[Done]:
        with self.lock:
            return [d for d in self.done if start <= d.end < end]


# ------------------------------------------------------------------ the soak


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def soak(args: argparse.Namespace) -> dict:
    server = Server(["--device=cpu", *shlex.split(args.serve_flags)])
    samples: list[dict] = []
    failures: list[str] = []
    try:
        load = Load(server.port, args.seed)
        start_metrics = server.metrics()
        total_pages = start_metrics["nsaserve_kv_pages_used"] + start_metrics["nsaserve_kv_pages_free"]
        threads = [threading.Thread(target=load.client, args=(i,), daemon=True) for i in range(args.concurrency)]
        threads.append(threading.Thread(target=load.client, args=(args.concurrency, True), daemon=True))
        t_start = time.time()
        for t in threads:
            t.start()
        window_start = t_start
        for k in range(1, int(args.duration_s // args.interval_s) + 1):
            time.sleep(max(0.0, t_start + k * args.interval_s - time.time()))
            window_end = time.time()
            rss = rss_bytes(process_tree(server.proc.pid))
            done = load.window(window_start, window_end)
            per_token = [d.ms_per_token for d in done if d.ms_per_token is not None]
            ttft = [d.ttft_ms for d in done if d.ttft_ms is not None]
            probe = [d.probe_ms for d in done if d.probe_ms is not None]
            samples.append(
                {
                    "t_s": round(window_end - t_start, 1),
                    "warmup": window_end - t_start <= args.warmup_s + 1e-6,
                    "rss_mib": round(rss / 2**20, 1),
                    "load_avg_1m": round(os.getloadavg()[0], 2),  # other work on the machine skews latency
                    "requests": len(done),
                    "abandoned": sum(d.abandoned for d in done),
                    "failed": sum(not d.ok for d in done),
                    "probe_ms_p50": pct(probe, 0.5),
                    "ms_per_token_p50": pct(per_token, 0.5),
                    "ms_per_token_p99": pct(per_token, 0.99),
                    "ttft_ms_p50": pct(ttft, 0.5),
                }
            )
            if args.verbose:
                print(json.dumps(samples[-1]), flush=True)
            window_start = window_end
        load.stop.set()
        for t in threads:
            t.join(timeout=900)
        # Drain: nothing running or waiting, then every page must be free (cached pages count
        # as free: the radix cache gives them back on demand).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = server.metrics()
            if m["nsaserve_requests_running"] == 0 and m["nsaserve_requests_waiting"] == 0:
                break
            time.sleep(0.5)
        end_metrics = server.metrics()
        errors = [d.error for d in load.done if not d.ok]
    except BaseException:
        server.kill()
        raise
    exit_code = server.stop()

    steady = [s for s in samples if not s["warmup"]]
    if not steady:
        raise SystemExit("no window after the warm-up: raise --duration-s or lower --warmup-s")
    base_rss = steady[0]["rss_mib"]
    base_probe = next((s["probe_ms_p50"] for s in steady if s["probe_ms_p50"]), None)
    for s in steady:
        s["rss_ratio"] = round(s["rss_mib"] / base_rss, 4)
        s["latency_ratio"] = round(s["probe_ms_p50"] / base_probe, 3) if s["probe_ms_p50"] and base_probe else None
    rss_worst = max(abs(s["rss_ratio"] - 1.0) for s in steady)
    if rss_worst > args.rss_tolerance:
        failures.append(f"resident memory moved {rss_worst:.1%} from the baseline (limit {args.rss_tolerance:.0%})")
    third = max(1, len(steady) // 3)
    first = statistics.median([s["probe_ms_p50"] for s in steady[:third] if s["probe_ms_p50"]] or [0])
    last = statistics.median([s["probe_ms_p50"] for s in steady[-third:] if s["probe_ms_p50"]] or [0])
    drift = last / first if first else float("inf")
    if drift > args.latency_tolerance:
        failures.append(f"latency drifted {drift:.2f}x (limit {args.latency_tolerance}x)")
    if errors:
        failures.append(f"{len(errors)} requests failed, e.g. {errors[0]}")
    if end_metrics["nsaserve_kv_pages_used"] != 0 or end_metrics["nsaserve_kv_pages_free"] != total_pages:
        failures.append(
            f"KV pool not full after the drain: {end_metrics['nsaserve_kv_pages_used']:.0f} used, "
            f"{end_metrics['nsaserve_kv_pages_free']:.0f} of {total_pages:.0f} free"
        )
    if end_metrics["nsaserve_requests_running"] or end_metrics["nsaserve_requests_waiting"]:
        failures.append("requests still running or waiting after the drain")
    if exit_code != 0:
        failures.append(f"serve exited with {exit_code} on SIGTERM")
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "command": "python bench/soak.py " + " ".join(args.argv),
        "server": server.command,
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "md", "verbose", "argv")},
        "requests": len(load.done),
        "abandoned": sum(d.abandoned for d in load.done),
        "failed": len(errors),
        "kv_pages_total": total_pages,
        "kv_pages_used_after_drain": end_metrics["nsaserve_kv_pages_used"],
        "rss_worst_deviation": round(rss_worst, 4),
        "latency_drift": round(drift, 3),
        "serve_exit_code": exit_code,
        "samples": samples,
        "failures": failures,
        "ok": not failures,
    }


def markdown(r: dict) -> str:
    lines = [
        f"# Soak: {r['config']['duration_s'] / 60:.0f} minutes of mixed load ({r['date']})",
        "",
        f"Machine: {r['machine']}. Command: `{r['command']}`. Server: `{r['server']}`.",
        f"Load: {r['config']['concurrency']} clients; completions and chat, streaming and not, random lengths, "
        f"about 1 in 10 abandoned; plus one probe client (a fixed 16-token completion, over and over). Warm-up {r['config']['warmup_s']} s; the baseline (ratio 1) is the first window after it.",
        "",
        f"Requests {r['requests']} (abandoned {r['abandoned']}, failed {r['failed']}); worst resident-memory "
        f"deviation {r['rss_worst_deviation']:.1%}; probe latency drift (last third / first third) {r['latency_drift']:.2f}x; "
        f"KV pages used after the drain {r['kv_pages_used_after_drain']:.0f} of {r['kv_pages_total']:.0f}; "
        f"exit code on SIGTERM {r['serve_exit_code']}. Result: **{'pass' if r['ok'] else 'FAIL'}**"
        + ("" if r["ok"] else " (" + "; ".join(r["failures"]) + ")"),
        "",
        "| t (s) | RSS MiB | RSS ratio | requests | abandoned | failed | probe ms p50 | probe ratio | ms/token p50 | p99 | TTFT p50 ms | load avg |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(v, spec=".1f"):
        return "" if v is None else format(v, spec)

    for s in r["samples"]:
        lines.append(
            f"| {s['t_s']:.0f}{' (warm-up)' if s['warmup'] else ''} | {s['rss_mib']:.0f} | {f(s.get('rss_ratio'), '.3f')} | "
            f"{s['requests']} | {s['abandoned']} | {s['failed']} | {f(s['probe_ms_p50'], '.0f')} | "
            f"{f(s.get('latency_ratio'), '.2f')} | {f(s['ms_per_token_p50'])} | {f(s['ms_per_token_p99'])} | "
            f"{f(s['ttft_ms_p50'], '.0f')} | {s['load_avg_1m']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=1800)
    p.add_argument("--warmup-s", type=float, default=120)
    p.add_argument("--interval-s", type=float, default=60)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rss-tolerance", type=float, default=0.10)
    p.add_argument("--latency-tolerance", type=float, default=1.5)
    p.add_argument("--serve-flags", default="", help="extra `nsaserve serve` flags, as one string")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--md", default=None, help="write a markdown table here")
    p.add_argument("--verbose", action="store_true", help="print every window")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = soak(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.md:
        Path(args.md).write_text(markdown(result))
    print(markdown(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
