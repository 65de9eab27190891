"""The sweep plot: throughput and latency against concurrency. matplotlib is optional (the
`bench` extra); without it the plot is skipped and the caller says so."""

from __future__ import annotations

import textwrap


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_sweep(runs: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    runs = sorted(runs, key=lambda r: r["max_concurrency"])  # a sweep may run its levels in any order
    levels = [r["max_concurrency"] for r in runs]
    summ = [r["summary"] for r in runs]
    fig, (tput, lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label in (("output_throughput", "output tok/s"), ("total_throughput", "total tok/s")):
        tput.plot(levels, [s[key] for s in summ], marker="o", label=label)
    tput.set_ylabel("tokens / s")
    metrics = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e_latency", "E2E"))
    for i, (key, label) in enumerate(metrics):
        for p, style in (("p50_ms", "-"), ("p99_ms", "--")):  # one colour per metric, p99 dashed
            ys = [s[key][p] for s in summ]
            if any(y is not None for y in ys):
                ys = [float("nan") if y is None else y for y in ys]
                lat.plot(levels, ys, style, color=f"C{i}", marker="o", label=f"{label} {p[:-3]}")
    lat.set_ylabel("ms")
    lat.set_yscale("log")
    for ax in (tput, lat):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_xticks(levels, [str(v) for v in levels])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 180), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
