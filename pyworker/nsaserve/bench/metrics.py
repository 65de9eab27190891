"""Per-request results and the run summary.

Definitions (the ones sglang's and vLLM's bench_serving use, so numbers compare):
- TTFT: from sending the request to the arrival of the first chunk carrying generated text.
- TPOT, per request: (latency - TTFT) / (output tokens - 1), the first token excluded; only
  requests with at least 2 output tokens have one. Summaries are over requests.
- ITL: every gap between consecutive text chunks of a request, pooled over all requests. A chunk
  that carries several tokens is one gap (so with speculative decoding ITL > TPOT).
- E2E latency: from sending the request to the end of the response.
- Throughputs: successful requests' tokens (or count) divided by the run's wall time.
- Concurrency: the sum of request latencies divided by the wall time (mean requests in flight).
- TTFT after the first wave (with a concurrency limit and every request ready at once): TTFT of
  the requests sent after the first `max_concurrency` ones, i.e. those that joined a running batch
  when a slot freed, without the initial burst whose prompts all queue together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""
    sent_s: float = 0.0  # when it was sent, seconds after the run's start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def distribution(values_s: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 in milliseconds (numpy's linear interpolation between samples);
    None when there are no values."""
    if not values_s:
        return {"mean_ms": None, **{f"p{p}_ms": None for p in PERCENTILES}}
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {"mean_ms": float(a.mean()), **{f"p{p}_ms": float(np.percentile(a, p)) for p in PERCENTILES}}


def summarize(results: list[RequestResult], duration_s: float, max_errors: int = 5, first_wave: int = 0) -> dict:
    """The numbers of one run (warm-up excluded) over `duration_s` of wall time. first_wave > 0:
    also the TTFT of the requests sent after the first `first_wave` (see the module docstring)."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    errors: list[str] = []
    for r in failed:
        if r.error not in errors:
            errors.append(r.error)
        if len(errors) == max_errors:
            break
    out = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(failed),
        "first_errors": errors,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "input_throughput": per_s(input_tokens),
        "output_throughput": per_s(output_tokens),
        "total_throughput": per_s(input_tokens + output_tokens),
        "concurrency": per_s(sum(r.latency for r in ok)),
        "ttft": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl": distribution([gap for r in ok for gap in r.itl]),
        "e2e_latency": distribution([r.latency for r in ok]),
    }
    if first_wave > 0:
        later = sorted(results, key=lambda r: r.sent_s)[first_wave:]
        out["first_wave"] = first_wave
        out["ttft_after_first_wave"] = distribution([r.ttft for r in later if r.ok and r.ttft is not None])
    return out
