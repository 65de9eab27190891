"""bench/gpu/warmup_coverage.py's parts that need no GPU: the kernels it watches and the random
steps it runs (valid plans inside the warm-up's limits, spread over short and long contexts)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nsaserve.protocol.validate import validate_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))


def test_it_watches_the_kernels_of_every_family():
    """In a process of its own: under TRITON_INTERPRET (set for the CPU kernel tests) Triton's
    kernels are interpreted functions, which keep no compiled variants to count."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json, warmup_coverage as w; print(json.dumps(sorted(w.jit_kernels())))"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": os.pathsep.join(sys.path)},
                         capture_output=True, text=True, check=True)  # fmt: skip
    names = set(json.loads(out.stdout.splitlines()[-1]))
    for kernel in ("triton_topk._topk_streamed_kernel", "triton_moe_w4a16._moe_gate_up_kernel",
                   "triton_indexer._logits_kernel", "triton_sample_pick._sample_pick_kernel",
                   "gluon_sparse_mla._sparse_mla_gluon_kernel", "triton_moe_w4a16._moe_align_runs_kernel"):  # fmt: skip
        assert kernel in names, kernel


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
