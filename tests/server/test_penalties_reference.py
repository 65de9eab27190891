"""Penalties end to end against a whole-history reference. The router sends a request's penalty
history once and then only the tokens since (worker/penalty_history.py keeps the rest on rank 0),
under overlap and the worker pipeline, with requests joining and leaving the batch. The served
greedy outputs must equal the embedded model run in-process step by step with plans that carry
every request's whole history, sampled by the same sampler."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request

import pytest
import torch
from server_process import ServerProcess

from nsaserve.model.runner import ModelRunner
from nsaserve.protocol.builder import RequestSpec, SamplingSpec, build_plan
from nsaserve.serve import EMBEDDED_MODEL
from nsaserve.worker.sampler import SamplingBatch, sample

pytestmark = pytest.mark.skipif(not (EMBEDDED_MODEL / "config.json").exists(), reason="embedded model not built")

PAGE = 16
PENALTIES = [
    {"frequency_penalty": 1.5},
    {"repetition_penalty": 1.3, "presence_penalty": 0.5},
    {"repetition_penalty": 1.6, "frequency_penalty": 0.4, "presence_penalty": -0.3},
]
PROMPTS = [[5, 9, 13, 2, 7], [40, 41, 42, 43, 44, 45, 46, 47], [3, 3, 3, 3], [100, 20, 300, 40, 500, 60]]
MAX_TOKENS = [9, 24, 17, 30]  # different lengths: requests leave while others run on


def reference(runner: ModelRunner, prompt: list[int], penalties: dict, max_tokens: int) -> list[int]:
    spec = SamplingSpec(temperature=0.0, **penalties)
    tokens = list(prompt)
    pages = list(range(-(-(len(prompt) + max_tokens) // PAGE)))
    out = []
    for step in range(max_tokens):
        run = tokens if step == 0 else tokens[-1:]
        cached = len(tokens) - len(run)
        req = RequestSpec(1, run, cached, pages, sampling=spec, history=tokens, history_prompt_len=len(prompt), history_reset=True)
        plan = build_plan(step + 1, PAGE, [req])
        logits = runner.forward_plan(plan, None)
        token = int(sample(logits[-1:].float(), SamplingBatch.from_plan(plan, "cpu")).tokens[0])
        out.append(token)
        tokens.append(token)
    return out


def served(base_url: str, prompt: list[int], penalties: dict, max_tokens: int) -> list[str]:
    body = {"prompt": prompt, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, "logprobs": 0, **penalties}
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["logprobs"]["tokens"]


def test_served_penalised_outputs_equal_the_whole_history_reference():
    cases = [(p, PENALTIES[i % len(PENALTIES)], MAX_TOKENS[i]) for i, p in enumerate(PROMPTS)]
    runner = ModelRunner(str(EMBEDDED_MODEL), device=torch.device("cpu"), dtype=None, num_pages=8, page_size=PAGE, show_progress=False)
    want = [reference(runner, *c) for c in cases]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(EMBEDDED_MODEL / "tokenizer.json"))
    want_text = [[tok.decode([t], skip_special_tokens=False) for t in w] for w in want]
    # The check has teeth only if the histories change the outputs.
    plain = [reference(runner, p, {}, n) for p, _, n in cases]
    assert sum(w != p for w, p in zip(want, plain)) >= 2, "the penalties should change most outputs"
    server = ServerProcess("--device=cpu", f"--page-size={PAGE}").wait_ready()
    try:
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:  # together: one batch, joining and leaving
            got = list(pool.map(lambda c: served(server.base_url, *c), cases))
    finally:
        assert server.stop() == 0
    assert got == want_text
