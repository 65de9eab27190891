"""Penalised requests planned ahead (overlap): the router's history lacks the pending token, the
one the request runs this step by reference; the sampling batch appends it, from the plan's
resolved input or from the pipelined worker's device patch. Either way the penalties equal those
of the same request planned after the result, with its whole history in the plan."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from nsaserve.protocol.builder import RequestSpec, SamplingSpec, build_plan
from nsaserve.worker.batch import InputPatch
from nsaserve.worker.sampling_batch import SamplingBatch
from nsaserve.worker.sampling_logits import apply_bias_and_penalties

V = 60
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def requests(rng: random.Random, ahead: bool) -> list[RequestSpec]:
    """Penalised and plain requests, each running one decode token; with `ahead`, the penalised
    ones (and some plain ones) reference the previous step's row instead of carrying the token."""
    out, page = [], 0
    for i in range(8):
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 12))]
        generated = [rng.randrange(V) for _ in range(rng.randint(1, 12))]
        tokens = prompt + generated
        penalised = i % 3 != 2
        by_ref = ahead and (penalised or i % 2 == 0)
        sampling = (
            SamplingSpec(temperature=0.9, frequency_penalty=0.4, presence_penalty=0.3, repetition_penalty=1.2)
            if penalised
            else SamplingSpec(temperature=0.9)
        )
        history = (tokens[:-1] if by_ref else tokens) if penalised else []
        npages = -(-len(tokens) // 16)
        out.append(
            RequestSpec(
                id=i,
                input_ids=[-1] if by_ref else [tokens[-1]],
                cached_len=len(tokens) - 1,
                pages=list(range(page, page + npages)),
                input_prev_row=7 - i if by_ref else -1,
                sampling=sampling,
                history=history,
                history_prompt_len=len(prompt) if penalised else 0,
            )
        )
        page += npages
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_pending_token_joins_the_history(device, seed):
    after = build_plan(5, 16, requests(random.Random(seed), ahead=False))
    ahead = build_plan(5, 16, requests(random.Random(seed), ahead=True))
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(seed)).to(device) * 3
    want = apply_bias_and_penalties(logits, SamplingBatch.from_plan(after, device))

    # The host path: the previous step's tokens filled into input_ids (worker/prev_step.py).
    resolved = replace(ahead, input_ids=after.input_ids.copy())
    assert torch.equal(apply_bias_and_penalties(logits, SamplingBatch.from_plan(resolved, device)), want)

    # The pipelined path: input_ids stay -1; the tokens are on the device (worker/pipeline.py).
    refs = np.flatnonzero(ahead.input_prev_row >= 0)
    index = ahead.query_start[refs].astype(np.int64)
    tokens = torch.from_numpy(after.input_ids[index].astype(np.int64)).to(device)
    patch = InputPatch(index, tokens)
    assert torch.equal(apply_bias_and_penalties(logits, SamplingBatch.from_plan(ahead, device, patch)), want)


def test_an_unresolved_pending_token_penalises_nothing_extra():
    """An unresolved reference (input -1 and no patch: the worker drops such requests before
    sampling) reads as an id outside the vocabulary, which the penalties ignore: the history
    counts as the router sent it."""
    ahead = build_plan(5, 16, requests(random.Random(1), ahead=True))
    as_sent = replace(ahead, input_prev_row=np.full_like(ahead.input_prev_row, -1))
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(1)) * 3
    got = apply_bias_and_penalties(logits, SamplingBatch.from_plan(ahead, "cpu"))
    assert torch.equal(got, apply_bias_and_penalties(logits, SamplingBatch.from_plan(as_sent, "cpu")))
