"""What a run prints, and the JSON file it writes (with what is needed to reproduce it)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from .. import __version__


def machine_info() -> dict:
    """The client machine (the server may be elsewhere)."""
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "nsaserve": __version__,
    }
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout
            info["gpus"] = [line.strip() for line in out.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    return info


def document(args_dict: dict, runs: list[dict]) -> dict:
    return {
        # argv[0] is a path or __main__.py depending on how it was started; the arguments are exact.
        "command": shlex.join(["nsaserve", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "args": args_dict,
        "runs": runs,
    }


def write_json(path: str, doc: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def _fmt(v: float | None, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:,.{digits}f}"


def format_run(run: dict) -> str:
    """A human-readable table of one run's summary."""
    s = run["summary"]
    hit = run.get("prefix_hit_rate")
    rows = [
        ("Max concurrency", str(run.get("max_concurrency") or "unlimited")),
        ("Request rate (req/s)", str(run.get("request_rate"))),
        ("Successful requests", str(s["completed"])),
        ("Failed requests", str(s["failed"])),
        ("Duration (s)", _fmt(s["duration_s"])),
        ("Total input tokens", str(s["total_input_tokens"])),
        ("Total output tokens", str(s["total_output_tokens"])),
        ("Request throughput (req/s)", _fmt(s["request_throughput"])),
        ("Input throughput (tok/s)", _fmt(s["input_throughput"])),
        ("Output throughput (tok/s)", _fmt(s["output_throughput"])),
        ("Total throughput (tok/s)", _fmt(s["total_throughput"])),
        ("Concurrency (measured)", _fmt(s["concurrency"])),
        ("Prefix cache hit rate", "n/a" if hit is None else f"{hit:.1%}"),
    ]
    lines = [f"{k:<32}{v:>16}" for k, v in rows]
    lines.append(f"{'(ms)':<16}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}")
    keys = [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e_latency", "E2E latency")]
    if "ttft_after_first_wave" in s:
        keys.insert(1, ("ttft_after_first_wave", "TTFT (joined)"))
    for key, label in keys:
        d = s[key]
        lines.append(f"{label:<16}" + "".join(f"{_fmt(d[k]):>12}" for k in ("mean_ms", "p50_ms", "p90_ms", "p99_ms")))
    for e in s["first_errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def format_sweep(runs: list[dict]) -> str:
    """One line per concurrency level, for comparing levels at a glance."""
    head = f"{'concurrency':>12}{'req/s':>10}{'out tok/s':>12}{'total tok/s':>13}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}{'failed':>8}"
    lines = [head]
    for r in runs:
        s = r["summary"]
        cells = [
            f"{r['max_concurrency'] or 'unlimited':>12}",
            f"{_fmt(s['request_throughput']):>10}",
            f"{_fmt(s['output_throughput'], 0):>12}",
            f"{_fmt(s['total_throughput'], 0):>13}",
            *(f"{_fmt(s[k][p], 1):>10}" for k in ("ttft", "tpot") for p in ("p50_ms", "p99_ms")),
            f"{s['failed']:>8}",
        ]
        lines.append("".join(cells))
    return "\n".join(lines)
