"""Kernel warm-up before serving: synthetic steps through the model so that the GPU kernels'
variants are compiled before the first request, not in the middle of it.

Triton compiles a kernel variant the first time a launch needs it, 0.5-5 s each on the H200 for
the indexer, top-k, sparse MLA and MoE kernels. The kernels keep their variants few (sizes are
runtime values; what stays constant is a power-of-two bucket of the step's shape: tokens per
expert, longest context, rows per request, key blocks per program), but a new server still met
each bucket for the first time while serving: its first prompts of each size took 1.5-7.7 s
instead of 40-600 ms. The warm-up runs one step per bucket a server can meet:

- prompt chunks of 16, 32, 64, ... tokens up to the most a step holds, each after a cached prefix
  that takes it past the top-k (token-count buckets of the MoE kernels, prompt row blocks and
  key-span buckets of the indexer and its top-k, the sparse MLA prefill path);
- prompt chunks of several requests after cached prefixes (a radix-cache hit's step);
- decode batches of 1, 2, 3, 4, 6, 8, 12, ... requests (powers of two and the midpoints between
  them) up to the most that run at once, past the top-k (the decode path of every kernel, eagerly:
  CUDA graphs cover only their own batch sizes), at each power-of-two context bucket of the decode
  top-k up to its single chunk. Some variants change between powers of two: the sparse MLA stops
  splitting lists from 67 rows, the MoE pairs its larger experts' blocks from 129;
- whole prompts of 128, 256, ... tokens up to the top-k (the dense prompt path, or the unscored
  selection where it is off);
- one decode over a context longer than the top-k kernel's single chunk;
- each of the prompt and decode paths once more with a top-k list whose length is not a multiple
  of 16 (the sparse MLA kernel specialises its index row stride on that), one of them a whole
  prompt, whose top-k is its whole context;
- the decode batches over whole contexts within the top-k, their lists 1,024 wide (a multiple of
  16): a step's whole-context lists are as wide as its longest context, so serving meets both
  strides; in a mixed step the decode rows run the decode kernel at that width, eagerly. Missing
  until 2026-12-05: the compile watch (worker/compile_watch.py) caught the H200 compiling two such
  variants of the sparse MLA while serving, 1.6 s each;
- the sampler on random logits, once for each kind of rows a step can sample (SAMPLER_MIXES):
  its fused pick compiled on the first temperature request otherwise (0.7 s on the H200).

Triton keeps what it compiled on disk, so a restart on the same machine compiles nothing and the
warm-up costs the steps alone. KV: the steps write and read garbage in the pool's first pages
before any request exists; a request reads only slots that its own or an earlier request's steps
wrote, so nothing of the warm-up is ever read as data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..protocol.builder import RequestSpec, SamplingSpec, build_plan
from ..protocol.messages import Plan

# The top-k kernel's single chunk (kernels/triton_topk.CHUNK): longer contexts take its chunked form.
TOPK_CHUNK = 8192
SMALLEST_PROMPT = 16
# A prompt long enough for the sparse MLA prefill path (kernels/triton_sparse_mla.PREFILL_TOKENS)
# and a decode context, each giving a top-k list length that is not a multiple of 16.
ODD_PROMPT = 264
ODD_CONTEXT = 999
# A decode context whose whole-context list (context + 1 entries, within the top-k) is a multiple of 16.
EVEN_CONTEXT = 1023
# Whole prompts (no cached prefix) from this size up to the top-k.
WHOLE_PROMPT_FROM = 128


@dataclass
class WarmupShape:
    """The largest steps the server will run, as the router's limits set them."""

    max_tokens: int  # prompt tokens in one step (max prefill tokens / chunk size)
    max_batch: int  # requests decoding at once
    max_context: int  # longest context a request can reach
    # The model's top-k: steps whose contexts all fit it skip the indexer's scoring (model/attention.py),
    # so the steps meant for the indexer's kernels run past it.
    index_topk: int = 2048


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, n = [], lo
    while n < hi:
        out.append(n)
        n *= 2
    return out + [hi] if hi >= lo else out


def _decode_batches(hi: int) -> list[int]:
    """Powers of two up to hi, the midpoints between them (3, 6, 12, ...) and hi itself."""
    powers = _powers_of_two(1, hi)
    return sorted(set(powers) | {3 * p // 2 for p in powers if 2 <= p and 3 * p // 2 < hi})


def warmup_steps(shape: WarmupShape, num_pages: int, page_size: int, vocab_size: int, dp_size: int = 1) -> list[tuple[str, Plan]]:
    """(name, plan) of every warm-up step. Requests share the pages [0, n) of each rank's pool
    (under data-parallel attention every rank gets a copy of each request, in its own pages, so
    that every rank compiles its attention kernels)."""
    usable = min(shape.max_context, num_pages * page_size) - 1  # longest context that fits the pool
    if usable < 1:
        return []
    rng = np.random.default_rng(0)

    def ids(n: int) -> list[int]:
        return rng.integers(0, vocab_size, n).tolist()

    def pages(rank: int, context: int) -> list[int]:
        return [rank * num_pages + p for p in range(-(-(context + 1) // page_size))]

    def plan(step: int, reqs: list[tuple[list[int], int]]) -> Plan:
        """reqs: (input ids, cached length) per request, copied onto every rank's pages."""
        specs = [
            RequestSpec(i * dp_size + r, tokens, cached, pages(r, cached + len(tokens)))
            for i, (tokens, cached) in enumerate(reqs)
            for r in range(dp_size)
        ]
        return build_plan(step, page_size, specs)

    steps: list[tuple[str, Plan]] = []
    # Prompt chunks of every size bucket, each after a cached prefix that takes its context past
    # the top-k (where it fits), so the indexer scores them; one whole prompt of an odd size,
    # selected unscored.
    past = 2 * shape.index_topk
    for n in _powers_of_two(SMALLEST_PROMPT, min(shape.max_tokens, usable)):
        cached = max(0, min(past - n, usable - n))
        steps.append((f"prompt of {n} after {cached}", plan(len(steps), [(ids(n), cached)])))
    if min(shape.max_tokens, usable) >= ODD_PROMPT:
        steps.append((f"prompt of {ODD_PROMPT} after 0", plan(len(steps), [(ids(ODD_PROMPT), 0)])))
    # Whole prompts within the top-k, by size bucket: their contexts fit it, so they take the
    # dense prompt path where it is on (model/dense_prefill.py) and the unscored selection
    # otherwise; the dense path's first call of a size cost ~60 ms more on the H200 without this.
    for n in _powers_of_two(WHOLE_PROMPT_FROM, min(shape.max_tokens, usable, shape.index_topk)):
        steps.append((f"whole prompt of {n}", plan(len(steps), [(ids(n), 0)])))
    # A radix-cache hit's step: several requests' chunks after cached prefixes (past the top-k).
    new, cached = 32, min(2 * shape.index_topk - 32, usable - 32)
    if cached > 0:
        reqs = max(1, min(32, shape.max_tokens // new))
        steps.append((f"{reqs} chunks of {new} after {cached}", plan(len(steps), [(ids(new), cached)] * reqs)))
    # Decode contexts past the top-k at every power-of-two bucket of the decode top-k's single
    # chunk (its kernel is specialised on next_power_of_2(longest context) up to TOPK_CHUNK:
    # 4096 and 8192 at GLM-5's top-k), and one of an odd list length.
    past_topk = {2 * shape.index_topk, *_powers_of_two(2 * shape.index_topk, TOPK_CHUNK)}
    within = {min(ODD_CONTEXT, usable - 1), min(EVEN_CONTEXT, usable - 1, shape.index_topk - 1)}
    contexts = {min(c - 1, usable - 1) for c in past_topk} | within
    for context in sorted(contexts, reverse=True):
        if context > 0:
            for b in _decode_batches(max(1, shape.max_batch)):
                steps.append((f"decode of {b} at {context}", plan(len(steps), [(ids(1), context)] * b)))
    if usable - 1 > TOPK_CHUNK:
        long = min(usable - 1, TOPK_CHUNK + 64)
        steps.append((f"decode of 1 at {long}", plan(len(steps), [(ids(1), long)])))
    return steps


# The sampler's kernel variants follow which kinds of rows a step samples: greedy rows among the
# sampled ones or not, filters (top-k / top-p / min-p: a threshold the pick applies) or not, and
# penalties (float32 logits whatever the model's dtype). One small batch of each kind.
SAMPLER_MIXES: tuple[tuple[SamplingSpec, ...], ...] = (
    (SamplingSpec(), SamplingSpec(temperature=0.7)),
    (SamplingSpec(temperature=0.0), SamplingSpec(temperature=0.7)),
    (SamplingSpec(top_p=0.9), SamplingSpec(top_k=20, seed=7)),
    (SamplingSpec(temperature=0.0), SamplingSpec(top_p=0.95)),
    (SamplingSpec(temperature=0.0), SamplingSpec(top_k=20, min_p=0.05, repetition_penalty=1.1, top_logprobs=3)),
)


def sampler_plans(page_size: int) -> list[Plan]:
    """One decode plan (a request per row, on page 0, with a token history for the penalties) for
    each of SAMPLER_MIXES."""
    return [
        build_plan(i, page_size, [RequestSpec(r, [1 + r], 3, [0], sampling=spec, history=[1, 2, 3, 1 + r], history_prompt_len=3)
                                  for r, spec in enumerate(mix)])  # fmt: skip
        for i, mix in enumerate(SAMPLER_MIXES)
    ]


def warm_up_sampler(device, vocab_size: int, page_size: int, model_dtype=None) -> None:
    """Samples random logits once per SAMPLER_MIXES batch, in float32 (eager steps, penalised rows)
    and in the model's dtype (decode graphs hand over lm_head's rows as they are): the kernels are
    specialised on it. A generator of its own: the default generator, which seeds a launch's
    unseeded draws, is left as it was."""
    import torch

    from ..kernels.registry import resolve
    from .sampler import SamplingBatch, sample
    from .sampling_logprobs import token_logprobs

    g = torch.Generator(device=device).manual_seed(0)
    dtypes = dict.fromkeys((torch.float32, model_dtype or torch.float32))
    for plan in sampler_plans(page_size):
        sb = SamplingBatch.from_plan(plan, device)
        for dtype in dtypes:
            logits = torch.randn(sb.num_rows, vocab_size, device=device, generator=g).to(dtype)
            sample(logits, sb, generator=g)
    # The Triton lse + top-k of the logprobs splits the rows of small batches into pieces (the
    # mixes above) and gives larger ones a program per row: that form too.
    if resolve("row_lse_topk", "auto", torch.device(device).type) == "triton":
        from ..kernels.triton_row_lse_topk import PROGRAMS_WANTED

        rows = PROGRAMS_WANTED // 2 + 1
        for dtype in dtypes:
            logits = torch.randn(rows, vocab_size, device=device, generator=g).to(dtype)
            token_logprobs(logits, torch.zeros(rows, dtype=torch.int64, device=device), 5)


def warm_up(runner, shape: WarmupShape, log=None) -> tuple[int, float]:
    """Runs the warm-up steps through runner.forward_plan (every rank runs the same steps, so their
    collectives pair up), then the sampler's kinds of rows. -> (model steps run, seconds)."""
    t0 = time.perf_counter()
    steps = warmup_steps(shape, runner.num_pages, runner.page_size, runner.vocab_size, getattr(runner, "dp_size", 1))
    for _, plan in steps:
        runner.forward_plan(plan)
    warm_up_sampler(runner.device, runner.vocab_size, runner.page_size, getattr(runner, "dtype", None))
    if runner.device.type == "cuda":
        import torch

        torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - t0
    if log is not None:
        log(f"warm-up: {len(steps)} steps in {seconds:.1f} s")
    return len(steps), seconds
