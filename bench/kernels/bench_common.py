"""Shared pieces of the kernel benchmarks: ceilings measured in the same run, graph timing, results.

Every benchmark measures its own ceilings (a large device-to-device copy for bandwidth, a large
random bf16 matmul for the MMA rate) so that "fraction of roofline" is against this card, now.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

import torch


def _median_ms(fn, reps: int, per_call: int = 1) -> float:
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / per_call)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy."""
    n = 1 << 31
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = _median_ms(lambda: dst.copy_(src), 20)
    return 2 * n / (ms * 1e-3)


def bf16_matmul_rate() -> float:
    """FLOP/s of an 8192^3 bf16 matmul on random data."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ms = _median_ms(lambda: a @ b, 10)
    return 2 * n**3 / (ms * 1e-3)


def ceilings(copy_bps: float) -> dict:
    """The results files' ceilings: the copy bandwidth measured by the caller and the bf16 matmul
    rate measured now."""
    return {"copy_TBps": copy_bps / 1e12, "bf16_TFLOPs": bf16_matmul_rate() / 1e12}


def rows_args(default_rows: str = "1,64,256,1024") -> tuple[argparse.Namespace, list[int]]:
    """--out (the results directory) and --rows (batch sizes, comma-separated), parsed."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--rows", default=default_rows)
    args = ap.parse_args()
    return args, [int(v) for v in args.rows.split(",")]


def graph_time_us(calls: list, reps: int = 30) -> float:
    """Median microseconds per call of `calls` (each a zero-argument function, typically the same
    kernel on different buffers so that L2 does not hold the inputs), replayed as one CUDA graph."""
    for c in calls:  # compile and warm up outside the capture
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(3):
        g.replay()
    return 1e3 * _median_ms(g.replay, reps, per_call=len(calls))


def eager_time_us(call, reps: int = 50) -> float:
    """Median microseconds of back-to-back eager calls (host overhead included where it dominates)."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    return 1e3 * _median_ms(lambda: [call() for _ in range(10)], reps, per_call=10)


def machine() -> dict:
    p = torch.cuda.get_device_properties(0)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "gpu": p.name,
        "sms": p.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def git_rev() -> str | None:
    try:
        return (
            subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
            or None
        )
    except OSError:
        return None


def write_results(
    name: str, out_dir: str, ceilings: dict, rows: list[dict], columns: list[str], notes: str = ""
) -> str:
    """bench/results/<date>-<name>.{json,md}: date, machine, command, ceilings and one row per case."""
    os.makedirs(out_dir, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    stem = os.path.join(out_dir, f"{now:%Y-%m-%d}-{name}")
    meta = {
        "date": now.isoformat(timespec="seconds"),
        "machine": machine(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "git": git_rev(),
        "ceilings": ceilings,
    }
    with open(stem + ".json", "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)
    lines = [
        f"# {name}",
        "",
        f"- date: {meta['date']}",
        f"- machine: {meta['machine']}",
        f"- command: `{meta['command']}`",
        f"- ceilings measured in this run: copy {ceilings['copy_TBps']:.2f} TB/s (read + write), "
        f"bf16 matmul {ceilings['bf16_TFLOPs']:.0f} TFLOP/s",
    ]
    if notes:
        lines += ["", notes]
    lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return stem


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def run_per_rows(name: str, case, params: list[tuple], columns: list[str], notes: str) -> None:
    """The main of a per-row-count benchmark: --out and --rows parsed, the copy bandwidth and matmul
    rate measured, `case(rows, *p, copy_bps)` (a list of result rows) run for every row count and
    every p in `params`, the table printed and the results written as bench/results/<date>-<name>."""
    args, row_counts = rows_args()
    copy_bps = copy_bandwidth()
    measured = ceilings(copy_bps)
    rows = []
    for r in row_counts:
        for p in params:
            got = case(r, *p, copy_bps)
            rows += got
            for line in got:
                print(line, flush=True)
        torch.cuda.empty_cache()
    print_table(rows, columns)
    print(write_results(name, out_dir=args.out, ceilings=measured, rows=rows, columns=columns, notes=notes))
