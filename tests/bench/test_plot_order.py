"""A sweep's plot draws its levels in concurrency order, whatever order they ran in (a sweep may
run the level that matters most first): lines through unsorted points zig-zag."""

import pytest

pytest.importorskip("matplotlib")

import matplotlib.axes  # noqa: E402

from nsaserve.bench.plot import plot_sweep  # noqa: E402


def _run(level: int) -> dict:
    lat = {"mean_ms": 1.0, "p50_ms": 1.0 * level, "p90_ms": 2.0, "p99_ms": 3.0}
    summary = {"output_throughput": 10.0 * level, "total_throughput": 20.0 * level}
    summary.update({k: dict(lat) for k in ("ttft", "tpot", "itl", "e2e_latency")})
    return {"max_concurrency": level, "summary": summary}


def test_levels_plotted_in_concurrency_order(tmp_path, monkeypatch):
    drawn = []
    real_plot = matplotlib.axes.Axes.plot

    def spy(self, xs, ys, *args, **kwargs):
        drawn.append((list(xs), list(ys)))
        return real_plot(self, xs, ys, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    runs = [_run(256), _run(1024), _run(64), _run(512)]
    plot_sweep(runs, str(tmp_path / "sweep.png"), "title")
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert drawn and all(xs == [64, 256, 512, 1024] for xs, _ in drawn)
    assert drawn[0][1] == [640.0, 2560.0, 5120.0, 10240.0]  # each value stays with its level
    assert [r["max_concurrency"] for r in runs] == [256, 1024, 64, 512]  # the caller's list untouched
