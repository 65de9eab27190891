"""Benchmark: the router alone. `nsaserve serve --model-executor null` (workers return tokens
at once, no model) under wrk, against the ceiling measured in the same run: a trivial axum
server answering the same request with a fixed completion (router/benches/http_ceiling.rs).

Throughput is measured with many connections; added latency at a light load (few connections),
where neither server is saturated. --endpoints runs the same short generation through each API
shape (completions, chat completions, the Responses API, Anthropic's Messages API), each against
the same ceiling.

    python bench/bench_router.py [--seconds 10] [--endpoints completions,chat,responses,messages] [--json PATH]
    (needs wrk and cargo)
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
# The same generation (4 tokens after the same user text) through each API shape.
_SAME = {"temperature": 0, "ignore_eos": True}
_USER = [{"role": "user", "content": "Beautiful is better than"}]
ENDPOINTS = {
    "completions": ("/v1/completions", BODY),
    "chat": ("/v1/chat/completions", {"messages": _USER, "max_tokens": 4, **_SAME}),
    "responses": ("/v1/responses", {"input": "Beautiful is better than", "max_output_tokens": 4, **_SAME}),
    "messages": ("/v1/messages", {"messages": _USER, "max_tokens": 4, **_SAME}),
}


def wait_http(url: str, timeout: float = 120, body: dict = BODY) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=5)
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
    p.add_argument("--endpoints", default="completions", help=f"comma-separated, of {','.join(ENDPOINTS)}")
    args = p.parse_args()
    endpoints = [e for e in args.endpoints.split(",") if e]
    if not endpoints or any(e not in ENDPOINTS for e in endpoints):
        sys.exit(f"--endpoints: comma-separated names of {list(ENDPOINTS)}")
    if not shutil.which("wrk"):
        sys.exit("wrk is needed (e.g. apt-get install wrk)")
    tmp = tempfile.mkdtemp()
    luas = {}
    for name in endpoints:
        luas[name] = os.path.join(tmp, f"{name}.lua")
        with open(luas[name], "w") as f:
            f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n')
            f.write(f"wrk.body = {json.dumps(json.dumps(ENDPOINTS[name][1]))}\n")

    results = {}
    serve = subprocess.Popen(
        [sys.executable, "-m", "nsaserve", "serve", "--model-executor", "null", "--port", "30901", "--max-running-requests", "1024"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_http("http://127.0.0.1:30901/v1/completions")
        for name in endpoints:
            path, body = ENDPOINTS[name]
            url = "http://127.0.0.1:30901" + path
            wait_http(url, body=body)
            lua = luas[name]
            key = "nsaserve_null" if name == "completions" else f"nsaserve_null_{name}"
            results[key] = [wrk(url, args.heavy_connections, args.seconds, lua), wrk(url, args.light_connections, args.seconds, lua)]
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=30)
    lua = luas[endpoints[0]]

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

    ceil = results["ceiling_trivial_axum"]
    per_endpoint = {}
    for name in endpoints:
        ours = results["nsaserve_null" if name == "completions" else f"nsaserve_null_{name}"]
        per_endpoint[name] = {
            "path": ENDPOINTS[name][0],
            "request": ENDPOINTS[name][1],
            "throughput_over_ceiling": ours[0]["requests_per_s"] / ceil[0]["requests_per_s"],
            "added_latency_light_load_ms": {k: ours[1][k] - ceil[1][k] for k in ("p50_ms", "p99_ms") if k in ours[1] and k in ceil[1]},
        }
    first = per_endpoint[endpoints[0]]
    report = {
        "benchmark": "router_null_executor",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.platform()}, {os.cpu_count()} cores",
        "command": " ".join(["python", "bench/bench_router.py", *sys.argv[1:]]),
        "request": first["request"],
        "results": results,
        "throughput_over_ceiling": first["throughput_over_ceiling"],
        "added_latency_light_load_ms": first["added_latency_light_load_ms"],
        "endpoints": per_endpoint,
        "targets": {"requests_per_s": 10000, "added_p99_ms": 2.0},
    }
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
