"""bench/gpu/warmup_coverage.py's random steps, which need no GPU: valid plans inside the warm-up's
limits, spread over short and long contexts. (The kernels it watches: tests/kernels/
test_kernel_specialization.py lists them.)"""

import sys
from pathlib import Path

import numpy as np

from nsaserve.protocol.validate import validate_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))


def test_random_steps_are_valid_plans_inside_the_limits():
    from warmup_coverage import parse_args, pool_pages, random_plans

    a = parse_args(["--model-path", "m", "--out", "o", "--steps", "60", "--max-context", "20000"])
    max_tokens, max_batch = 4096, 64
    num_pages = pool_pages(a, (max_tokens, max_batch))
    modes, longest = set(), []
    for _, plan in random_plans(a, (max_tokens, max_batch), 1000, num_pages):
        runnable, errors = validate_plan(plan, num_pages, vocab_size=1000)
        assert not errors and runnable.num_reqs == plan.num_reqs
        assert plan.num_tokens <= max_tokens + max_batch and plan.num_reqs <= max_batch + 8
        context = plan.cached_lens.astype(np.int64) + np.diff(plan.query_start.astype(np.int64))
        assert context.max() <= a.max_context
        modes.add(plan.mode)
        longest.append(int(context.max()))
    assert modes == {"decode", "prefill", "mixed"}
    assert min(longest) < 2048 < max(longest) and max(longest) > 8192  # both sides of the top-k
    # Both index row strides of whole-context lists: longest contexts on and off multiples of 16.
    short = [n for n in longest if n <= 2048]
    assert any(n % 16 == 0 for n in short) and any(n % 16 for n in short)
    # (every other step aims its longest context at a multiple of 16; a prompt longer than the
    # aim, or without a prefix, is its own longest context)
    assert sum(n % 16 == 0 for n in longest[1::2]) >= len(longest[1::2]) // 2
