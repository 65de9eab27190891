"""The null executor (`--model-executor null`, for measuring the router alone) answers a request
that asks for logprobs with well-formed ones, so router benchmarks exercise that path too."""

from __future__ import annotations

from nsaserve.protocol.builder import RequestSpec, SamplingSpec, build_plan
from nsaserve.worker.executor import NullExecutor


def test_logprobs_come_back_where_asked_and_only_there():
    ex = NullExecutor(vocab_size=7, num_pages=16, page_size=4, max_context=64)
    plan = build_plan(
        1,
        4,
        [
            RequestSpec(1, [3, 4], 0, [0], sampling=SamplingSpec(top_logprobs=3)),
            RequestSpec(2, [5], 0, [1]),
            RequestSpec(3, [6], 0, [2], sampling=SamplingSpec(top_logprobs=50)),  # more than the vocabulary
        ],
    )
    got = {req: (tok, lp) for req, tok, lp in ex.run(plan, True).sampled}
    tok, lp = got[1]
    assert lp.logprob == -0.5 and [t for t, _ in lp.top] == [tok, (tok + 1) % 7, (tok + 2) % 7]
    assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    assert got[2][1] is None
    assert len(got[3][1].top) == 7


def test_masked_rows_take_an_allowed_token():
    """Structured output: the null executor honours allowed-token masks (the next allowed id up,
    wrapping), so a router run under it follows each request's grammar."""
    ex = NullExecutor(vocab_size=40, num_pages=16, page_size=4, max_context=64)
    free = build_plan(1, 4, [RequestSpec(1, [3, 4], 0, [0])])
    own = ex.run(free, True).sampled[0][1]
    above, below = (own + 2) % 40, (own + 40 - 3) % 40
    for allowed in ([above], [below], [own, below], [below, above]):
        want = min([t for t in allowed if t >= own], default=min(allowed))
        words = [0, 0]
        for t in allowed:
            words[t // 32] |= 1 << (t % 32)
        plan = build_plan(1, 4, [RequestSpec(1, [3, 4], 0, [0], allowed_tokens=words)])
        assert ex.run(plan, True).sampled[0][1] == want, (allowed, own)
