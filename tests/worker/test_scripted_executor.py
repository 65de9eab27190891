"""The test-only scripted executor in-process: chosen only by the test environment, it reads a
prompt back through the page table (chunked prefill and a radix-cache hit included), emits its
reply one token per step through the real sampler, then EOS."""

from __future__ import annotations

import json

import pytest

from nsaserve.protocol.builder import RequestSpec, SamplingSpec, build_plan
from nsaserve.serve import EMBEDDED_MODEL
from nsaserve.worker.executor import NullExecutor
from nsaserve.worker.main import build_executor, parse_args

pytest.importorskip("tokenizers")
from nsaserve.worker.scripted_executor import ScriptedExecutor  # noqa: E402

PS = 4


@pytest.fixture
def executor(tmp_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(EMBEDDED_MODEL / "tokenizer.json"))
    script = tmp_path / "script.json"
    record = tmp_path / "prompts.jsonl"
    script.write_text(json.dumps({"record": str(record), "replies": [{"marker": "Beautiful", "text": "ugly!"}]}))
    ex = ScriptedExecutor(
        script_path=str(script),
        model_path=str(EMBEDDED_MODEL),
        vocab_size=640,
        num_pages=16,
        page_size=PS,
        max_context=64,
    )
    return ex, tok, record


def test_only_the_test_environment_selects_it(monkeypatch, tmp_path):
    args = parse_args(["--rank=0", "--tp-size=1", f"--model-path={EMBEDDED_MODEL}", "--model-executor=null"])
    monkeypatch.delenv("NSASERVE_TEST_SCRIPT", raising=False)
    assert isinstance(build_executor(args), NullExecutor)
    (tmp_path / "s.json").write_text("{}")
    monkeypatch.setenv("NSASERVE_TEST_SCRIPT", str(tmp_path / "s.json"))
    assert build_executor(args).model_id == "scripted"


def run_reply(ex, rid: int, prompt: list[int], pages: list[int], cached: int, chunk: int, steps: int) -> list[int]:
    """Prefill `prompt[cached:]` in chunks of `chunk`, then decode `steps` tokens."""
    out, pos, step = [], cached, 1
    while pos < len(prompt):
        piece = prompt[pos : pos + chunk]
        last = pos + len(piece) == len(prompt)
        res = ex.run(build_plan(step, PS, [RequestSpec(rid, piece, pos, pages, sample=last)]), True)
        assert not res.errors
        if last:
            out.append(res.sampled[0][1])
        pos += len(piece)
        step += 1
    for _ in range(steps):
        spec = RequestSpec(rid, [out[-1]], pos, pages, sampling=SamplingSpec(temperature=0.7, top_logprobs=1))
        res = ex.run(build_plan(step, PS, [spec]), True)
        tok, lp = res.sampled[0][1], res.sampled[0][2]
        assert lp.logprob > -1e-6 and lp.top[0][0] == tok
        out.append(tok)
        pos += 1
        step += 1
    return out


def test_reply_then_eos_through_chunks_and_a_cached_prefix(executor):
    ex, tok, record = executor
    prompt = tok.encode(
        "Beautiful is better than ugly. Explicit is better than implicit. Simple is", add_special_tokens=False
    ).ids
    reply = tok.encode("ugly!", add_special_tokens=False).ids
    pages = list(range(-(-(len(prompt) + len(reply) + 2) // PS)))
    got = run_reply(ex, 1, prompt, pages, cached=0, chunk=3, steps=len(reply) + 1)
    assert got == reply + [ex.eos, ex.eos]
    # A second request reusing the first one's pages for a cached prefix: its prompt is read
    # back through its own page table, the cached part from what request 1 wrote.
    cached = ((len(prompt) - 1) // PS) * PS  # the router always leaves a token to run
    assert cached >= PS
    fresh = list(range(len(pages), len(pages) + 3))
    got = run_reply(ex, 2, prompt, pages[: cached // PS] + fresh, cached=cached, chunk=8, steps=len(reply))
    assert got == reply + [ex.eos]
    prompts = [json.loads(line) for line in record.read_text().splitlines()]
    assert [p["prompt_ids"] for p in prompts] == [prompt, prompt]


def test_unmatched_prompt_and_prompt_logprobs_fail_only_that_request(executor):
    ex, tok, _ = executor
    good = tok.encode("Beautiful", add_special_tokens=False).ids
    other = tok.encode("Flat is", add_special_tokens=False).ids
    plan = build_plan(
        1,
        PS,
        [
            RequestSpec(1, good, 0, [0, 1]),
            RequestSpec(2, other, 0, [2, 3]),
            RequestSpec(3, good, 0, [4, 5], prompt_logprobs=True),
        ],
    )
    res = ex.run(plan, True)
    assert [r for r, _, _ in res.sampled] == [1]
    assert sorted(r for r, _ in res.errors) == [2, 3]
    assert any("no script entry" in m for _, m in res.errors)


def test_parse_args_is_unchanged_by_the_hook():
    # The hook adds no flag: the scripted executor cannot be asked for on a command line.
    with pytest.raises(SystemExit):
        parse_args(["--rank=0", "--tp-size=1", "--model-executor=scripted"])
