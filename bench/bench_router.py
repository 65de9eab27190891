"""Benchmark: the router alone. `nsaserve serve --model-executor null` (workers return tokens
at once, no model) under wrk, against the ceiling measured in the same run: a trivial axum
server answering the same request with a fixed completion (router/benches/http_ceiling.rs).

Throughput is measured with many connections; added latency at a light load (few connections),
where neither server is saturated.

    python bench/bench_router.py [--seconds 10] [--json PATH]      (needs wrk and cargo)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BODY = {"prompt": "Beautiful is better than", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def wait_http(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(urllib.request.Request(url, data=json.dumps(BODY).encode(), headers={"Content-Type": "application/json"}), timeout=5)
            return
        except Exception:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer")


def wrk(url: str, connections: int, seconds: int, lua: str) -> dict:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", lua, url], capture_output=True, text=True, check=True
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    lat = {}
    for pct, value, unit in re.findall(r"^\s+(50|75|90|99)%\s+([\d.]+)(us|ms|s)$", out, re.M):
        lat[f"p{pct}_ms"] = float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"connections": connections, "requests_per_s": rps, **lat, "non_2xx": int(errors.group(1)) if errors else 0}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--heavy-connections", type=int, default=128)
    p.add_argument("--light-connections", type=int, default=4)
    p.add_argument("--json")
    args = p.parse_args()
    if not shutil.which("wrk"):
        sys.exit("wrk is needed (e.g. apt-get install wrk)")
    tmp = tempfile.mkdtemp()
    lua = os.path.join(tmp, "post.lua")
    with open(lua, "w") as f:
        f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n')
        f.write(f"wrk.body = {json.dumps(json.dumps(BODY))}\n")

    results = {}
    serve = subprocess.Popen(
        [sys.executable, "-m", "nsaserve", "serve", "--model-executor", "null", "--port", "30901", "--max-running-requests", "1024"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_http("http://127.0.0.1:30901/v1/completions")
        url = "http://127.0.0.1:30901/v1/completions"
        results["nsaserve_null"] = [wrk(url, args.heavy_connections, args.seconds, lua), wrk(url, args.light_connections, args.seconds, lua)]
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=30)

    ceiling = subprocess.Popen(
        ["cargo", "bench", "--quiet", "--bench", "http_ceiling", "--", "--port", "30902", "--seconds", str(4 * args.seconds + 60)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_http("http://127.0.0.1:30902/v1/completions", timeout=600)
        url = "http://127.0.0.1:30902/v1/completions"
        results["ceiling_trivial_axum"] = [wrk(url, args.heavy_connections, args.seconds, lua), wrk(url, args.light_connections, args.seconds, lua)]
    finally:
        ceiling.kill()
        ceiling.wait()

    ours, ceil = results["nsaserve_null"], results["ceiling_trivial_axum"]
    report = {
        "benchmark": "router_null_executor",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.platform()}, {os.cpu_count()} cores",
        "command": " ".join(["python", "bench/bench_router.py", *sys.argv[1:]]),
        "request": BODY,
        "results": results,
        "throughput_over_ceiling": ours[0]["requests_per_s"] / ceil[0]["requests_per_s"],
        "added_latency_light_load_ms": {k: ours[1][k] - ceil[1][k] for k in ("p50_ms", "p99_ms") if k in ours[1] and k in ceil[1]},
        "targets": {"requests_per_s": 10000, "added_p99_ms": 2.0},
    }
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
