"""The server's prefix-cache hit rate over a run, from its Prometheus /metrics counters.

Counters only grow, so the run's share is the difference between a scrape before and one after.
Servers without these counters (or without /metrics) give None, reported as "n/a".
"""

from __future__ import annotations

HIT_TOKENS = "nsaserve_prefix_cache_hit_tokens_total"
PROMPT_TOKENS = "nsaserve_prompt_tokens_total"


def parse_counters(text: str) -> dict[str, float]:
    """Sample values by metric name, summed over label sets (`name{a="b"} 3` and `name 3`)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        out[name.strip()] = out.get(name.strip(), 0.0) + value
    return out


def prefix_hit_rate(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Cached prompt tokens / prompt tokens, over the interval between the two scrapes."""
    if before is None or after is None:
        return None
    if not all(k in before and k in after for k in (HIT_TOKENS, PROMPT_TOKENS)):
        return None
    prompt = after[PROMPT_TOKENS] - before[PROMPT_TOKENS]
    if prompt <= 0:
        return None
    return (after[HIT_TOKENS] - before[HIT_TOKENS]) / prompt
