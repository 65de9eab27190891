"""The metrics math on synthetic timings, and the prefix hit rate from /metrics text."""

from __future__ import annotations

import numpy as np
import pytest

from nsaserve.bench.metrics import RequestResult, distribution, summarize
from nsaserve.bench.runner import arrival_times
from nsaserve.bench.server_metrics import parse_counters, prefix_hit_rate


def test_percentiles_interpolate_linearly_and_report_milliseconds():
    d = distribution([i / 1000 for i in range(1, 101)])  # 1 .. 100 ms
    assert d["mean_ms"] == pytest.approx(50.5)
    assert d["p50_ms"] == pytest.approx(50.5)
    assert d["p90_ms"] == pytest.approx(90.1)
    assert d["p99_ms"] == pytest.approx(99.01)
    assert distribution([]) == {"mean_ms": None, "p50_ms": None, "p90_ms": None, "p99_ms": None}


def test_tpot_excludes_the_first_token():
    # First token after 0.5 s, then 10 more tokens over 1.0 s: 0.1 s each, whatever the TTFT.
    assert RequestResult(ok=True, output_tokens=11, ttft=0.5, latency=1.5).tpot == pytest.approx(0.1)
    assert RequestResult(ok=True, output_tokens=1, ttft=0.5, latency=0.5).tpot is None
    assert RequestResult(ok=True, output_tokens=5, ttft=None, latency=0.5).tpot is None


def test_summary_throughputs_latencies_and_pooled_itl():
    a = RequestResult(ok=True, prompt_tokens=100, output_tokens=5, ttft=0.2, itl=[0.1, 0.1, 0.3, 0.3], latency=1.0)
    b = RequestResult(ok=True, prompt_tokens=300, output_tokens=3, ttft=0.4, itl=[0.2, 0.2], latency=0.8)
    bad = RequestResult(ok=False, latency=0.1, error="HTTP 500: boom")
    s = summarize([a, b, bad, RequestResult(ok=False, error="HTTP 500: boom"), RequestResult(ok=False, error="other")], 2.0)
    assert (s["completed"], s["failed"]) == (2, 3)
    assert s["first_errors"] == ["HTTP 500: boom", "other"]  # distinct messages, in order
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (400, 8)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["input_throughput"] == pytest.approx(200.0)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_throughput"] == pytest.approx(204.0)
    assert s["concurrency"] == pytest.approx(0.9)  # (1.0 + 0.8) / 2.0; failures excluded
    assert s["ttft"]["mean_ms"] == pytest.approx(300.0)
    # TPOT per request: a = 0.8 / 4 = 0.2 s, b = 0.4 / 2 = 0.2 s.
    assert s["tpot"]["mean_ms"] == pytest.approx(200.0) and s["tpot"]["p99_ms"] == pytest.approx(200.0)
    # ITL pools all six gaps: mean 0.2 s, median 0.2 s, p90 between 0.2 and 0.3.
    assert s["itl"]["mean_ms"] == pytest.approx(200.0)
    assert s["itl"]["p50_ms"] == pytest.approx(200.0)
    assert s["itl"]["p90_ms"] == pytest.approx(np.percentile([100, 100, 300, 300, 200, 200], 90))
    assert s["e2e_latency"]["p50_ms"] == pytest.approx(900.0)


def test_ttft_after_the_first_wave_leaves_out_the_first_sent():
    burst = [RequestResult(ok=True, output_tokens=2, ttft=2.0 + i, latency=3.0 + i, sent_s=0.0) for i in range(3)]
    joined = [RequestResult(ok=True, output_tokens=2, ttft=0.1 * (i + 1), latency=1.0, sent_s=5.0 + i) for i in range(3)]
    joined.append(RequestResult(ok=False, error="x", sent_s=9.0))
    s = summarize(joined[::-1] + burst, 10.0, first_wave=3)  # completion order does not matter
    assert s["first_wave"] == 3
    assert s["ttft_after_first_wave"]["p50_ms"] == pytest.approx(200.0)
    assert s["ttft"]["p50_ms"] == pytest.approx(1150.0)  # all six
    assert "ttft_after_first_wave" not in summarize(burst, 1.0)


def test_summary_of_an_all_failed_run_has_no_latencies():
    s = summarize([RequestResult(ok=False, error=f"e{i}") for i in range(9)], 1.0)
    assert s["completed"] == 0 and s["failed"] == 9 and len(s["first_errors"]) == 5
    assert s["ttft"]["p50_ms"] is None and s["output_throughput"] == 0.0


METRICS_TEXT = """# HELP nsaserve_requests_total HTTP requests.
# TYPE nsaserve_requests_total counter
nsaserve_requests_total{endpoint="/v1/completions",status="200"} 7
nsaserve_requests_total{endpoint="/v1/completions",status="429"} 2
nsaserve_prompt_tokens_total 1000
nsaserve_prefix_cache_hit_tokens_total 250
nsaserve_ttft_seconds_bucket{le="+Inf"} 9
"""


def test_counters_are_parsed_and_summed_over_labels():
    c = parse_counters(METRICS_TEXT)
    assert c["nsaserve_requests_total"] == 9
    assert c["nsaserve_prompt_tokens_total"] == 1000
    assert c["nsaserve_ttft_seconds_bucket"] == 9


def test_prefix_hit_rate_is_the_ratio_of_deltas_and_na_without_counters():
    before = parse_counters(METRICS_TEXT)
    after = dict(before, nsaserve_prompt_tokens_total=3000, nsaserve_prefix_cache_hit_tokens_total=1750)
    assert prefix_hit_rate(before, after) == pytest.approx(0.75)  # (1750 - 250) / (3000 - 1000)
    assert prefix_hit_rate(before, before) is None  # no prompt tokens in between
    assert prefix_hit_rate(None, after) is None
    other = {"vllm:prompt_tokens_total": 5.0}
    assert prefix_hit_rate(other, other) is None


def test_arrivals_are_all_at_once_for_inf_and_poisson_otherwise():
    assert arrival_times(np.random.default_rng(0), 4, float("inf")) == [0.0] * 4
    t = np.array(arrival_times(np.random.default_rng(0), 20000, 50.0))
    gaps = np.diff(t)
    assert t[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 50, rel=0.05)  # exponential: std equals the mean
    with pytest.raises(ValueError):
        arrival_times(np.random.default_rng(0), 3, 0.0)
