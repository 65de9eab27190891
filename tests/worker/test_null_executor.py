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
