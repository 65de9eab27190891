"""The served API through the official `openai` client and raw HTTP, against the embedded model:
greedy recital of the Zen of Python must be exact, streaming or not, alone or concurrent."""

from __future__ import annotations

import codecs
import concurrent.futures
import contextlib
import io
import json
import urllib.error
import urllib.request

import pytest

from nsaserve.serve import EMBEDDED_MODEL

pytestmark = pytest.mark.skipif(not (EMBEDDED_MODEL / "config.json").exists(), reason="embedded model not built")


def zen() -> str:
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


@pytest.fixture(scope="module")
def server():
    from server_process import DEVICE_FLAG, ServerProcess

    s = ServerProcess(DEVICE_FLAG, "--served-model-name=zen").wait_ready()
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, path: str, body, raw: bool = False) -> tuple[int, dict]:
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(server.base_url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_greedy_recital_is_exact(client):
    text = zen()
    prompt = "Beautiful is better than"
    rest = text[text.index(prompt) + len(prompt) :]
    out = client.completions.create(model="zen", prompt=prompt, max_tokens=400, temperature=0)
    choice = out.choices[0]
    assert choice.text == rest[: len(choice.text)] and len(choice.text) >= len(rest.rstrip()) - 1
    assert choice.finish_reason == "stop"
    assert (
        out.usage.completion_tokens > 50
        and out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    )


def test_streaming_equals_non_streaming(client):
    kwargs = dict(model="zen", prompt="Explicit is better than", max_tokens=60, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(pieces) == whole and len(pieces) > 5


def test_concurrent_identical_prompts_give_identical_outputs(client):
    prompts = ["Simple is better than", "Flat is better than", "Simple is better than", "Errors should never"] * 4

    def run(p):
        return p, client.completions.create(model="zen", prompt=p, max_tokens=40, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, prompts))
    by_prompt: dict[str, set[str]] = {}
    for p, t in results:
        by_prompt.setdefault(p, set()).add(t)
    assert all(len(v) == 1 for v in by_prompt.values()), by_prompt
    text = zen()
    for p, outs in by_prompt.items():
        (out,) = outs
        assert (p + out) in text or text.startswith(p + out, text.index(p)), (p, out)


def test_chat_recites(client):
    out = client.chat.completions.create(
        model="zen", messages=[{"role": "user", "content": "Recite the Zen of Python."}], max_tokens=400, temperature=0
    )
    msg = out.choices[0].message
    assert msg.role == "assistant" and "Beautiful is better than ugly." in msg.content


def test_logit_bias_restricts_greedy_tokens_and_leaves_logprobs_raw(client):
    """Through the official client: -100 on every token but one (the embedded model's vocabulary is
    640) makes greedy decoding write only that token, and +100 on one token does the same; the
    returned logprobs stay the model's own."""
    plain = client.completions.create(model="zen", prompt="Beautiful is", max_tokens=1, temperature=0, logprobs=2)
    only = {str(t): -100 for t in range(640) if t != 300}
    for bias in (only, {"300": 100}):
        one = client.completions.create(
            model="zen", prompt="Beautiful is", max_tokens=1, temperature=0, logit_bias=bias, logprobs=2
        )
        three = client.completions.create(
            model="zen", prompt="Beautiful is", max_tokens=3, temperature=0, logit_bias=bias
        )
        piece = one.choices[0].text
        assert piece and piece != plain.choices[0].text
        assert three.choices[0].text == piece * 3
        # The model's own top two are still the top two (the dict also holds the sampled token),
        # and the forced token carries its raw logprob, far below them.
        raw_top = plain.choices[0].logprobs.top_logprobs[0]
        assert raw_top.items() <= one.choices[0].logprobs.top_logprobs[0].items()
        assert one.choices[0].logprobs.token_logprobs[0] < min(raw_top.values())


def test_min_tokens_holds_off_eos_and_stop_strings(client):
    """vLLM's min_tokens through the official client (extra_body): the end of the recital's EOS
    is banned until the minimum (the text before it is the same), and a stop string completed
    before the minimum does not end the text; SGLang's min_new_tokens does the same."""
    end = "Namespaces are one honking great idea -- let's do more of"
    plain = client.completions.create(model="zen", prompt=end, max_tokens=20, temperature=0)
    assert plain.choices[0].finish_reason == "stop"
    k = plain.usage.completion_tokens
    for field in ("min_tokens", "min_new_tokens"):
        held = client.completions.create(
            model="zen", prompt=end, max_tokens=k + 8, temperature=0, extra_body={field: k + 4}
        )
        assert held.usage.completion_tokens >= k + 4, (field, held.usage)
        assert held.choices[0].text.startswith(plain.choices[0].text), field
    prompt = "Beautiful is better than"
    first = client.completions.create(model="zen", prompt=prompt, max_tokens=60, temperature=0, stop=["better"])
    n = first.usage.completion_tokens
    later = client.completions.create(
        model="zen", prompt=prompt, max_tokens=60, temperature=0, stop=["better"], extra_body={"min_tokens": n + 1}
    )
    assert later.choices[0].text.startswith(first.choices[0].text + "better")
    assert later.choices[0].finish_reason == "stop" and later.usage.completion_tokens > n


def test_structured_outputs_through_the_official_client(client):
    """The tiny model only ever recited the Zen of Python; constrained, it writes what the request
    asks for: a pydantic model through `chat.completions.parse` (response_format json_schema),
    vLLM's guided_choice / guided_regex / guided_json (extra_body), streaming or not, several
    samples, alongside a plain request whose recital must stay exact."""
    import re
    from typing import Literal

    from pydantic import BaseModel, Field

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]
        sure: bool
        score: int = Field(ge=0, le=100)  # bounded: a greedy tiny model may write digits forever

    ask = [{"role": "user", "content": "Is beautiful better than ugly?"}]
    done = client.chat.completions.parse(model="zen", messages=ask, response_format=Verdict, max_tokens=80, temperature=0)
    assert isinstance(done.choices[0].message.parsed, Verdict), done.choices[0].message.content
    assert done.choices[0].finish_reason == "stop"

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        plain = pool.submit(client.completions.create, model="zen", prompt="Beautiful is better than", max_tokens=40, temperature=0)
        choice = pool.submit(
            client.completions.create, model="zen", prompt="Flat is", max_tokens=20, n=3, temperature=1.0, seed=3,
            extra_body={"guided_choice": ["better than nested", "worse", "fine"]},
        )  # fmt: skip
        regex = pool.submit(
            client.completions.create, model="zen", prompt="Now", max_tokens=20, temperature=0.8,
            extra_body={"guided_regex": "[0-9]{3}-[a-z]{2,4}"},
        )  # fmt: skip
        obj = pool.submit(
            client.chat.completions.create, model="zen", messages=ask, max_tokens=60, temperature=0,
            response_format={"type": "json_object"},
        )  # fmt: skip
        assert plain.result().choices[0].text == zen().split("Beautiful is better than", 1)[1][: len(plain.result().choices[0].text)]
        assert {c.text for c in choice.result().choices} <= {"better than nested", "worse", "fine"}
        assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", regex.result().choices[0].text), regex.result().choices[0].text
        text = obj.result().choices[0].message.content
        if obj.result().choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
        else:  # out of tokens inside the object: still its start
            assert text.startswith("{"), text

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": False}
    stream = client.completions.create(model="zen", prompt="Count:", max_tokens=30, temperature=0, stream=True, extra_body={"guided_json": schema})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert set(json.loads(text)) == {"n"} and 0 <= json.loads(text)["n"] <= 9, text


def test_bad_structured_outputs_are_400(server):
    status, body = post(server, "/v1/completions", {"model": "zen", "prompt": "x", "guided_regex": "(unclosed"})
    assert status == 400 and body["error"]["param"] == "guided_regex", body
    schema = {"model": "zen", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}
    status, body = post(server, "/v1/chat/completions", schema)
    assert status == 400 and body["error"]["param"] == "response_format", body
    # A grammar that allowed_token_ids leave no token to follow: found at the first step, still a 400.
    _, y = post(server, "/tokenize", {"prompt": "y"})
    stuck = {"model": "zen", "prompt": "x", "guided_regex": "x", "allowed_token_ids": y["tokens"]}
    status, body = post(server, "/v1/completions", stuck)
    assert status == 400 and "allowed_token_ids" in body["error"]["message"], body


def test_allowed_token_ids_and_what_the_text_keeps(client, server):
    """vLLM's allowed_token_ids (only those tokens, every step, overlap or not), and
    include_stop_str_in_output / skip_special_tokens deciding what the text keeps."""
    _, tok = post(server, "/tokenize", {"prompt": "a b"})
    ids = tok["tokens"]
    out = client.completions.create(
        model="zen", prompt="Beautiful is", max_tokens=8, temperature=0.9, seed=1, extra_body={"allowed_token_ids": ids}
    )
    assert set(out.choices[0].text) <= set("a b") and out.usage.completion_tokens == 8, out.choices[0].text
    prompt = "Beautiful is better than"
    kept = client.completions.create(
        model="zen", prompt=prompt, max_tokens=60, temperature=0, stop=["better"],
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    cut = client.completions.create(model="zen", prompt=prompt, max_tokens=60, temperature=0, stop=["better"])
    assert kept.choices[0].text == cut.choices[0].text + "better", (kept.choices[0].text, cut.choices[0].text)
    end = "Namespaces are one honking great idea -- let's do more of"
    shown = client.completions.create(
        model="zen", prompt=end, max_tokens=20, temperature=0,
        extra_body={"include_stop_str_in_output": True, "skip_special_tokens": False},
    )  # fmt: skip
    plain = client.completions.create(model="zen", prompt=end, max_tokens=20, temperature=0)
    assert shown.choices[0].text == plain.choices[0].text + "<|endoftext|>", shown.choices[0].text


def test_stop_string_is_not_leaked(client):
    out = client.completions.create(
        model="zen", prompt="Beautiful is better than", max_tokens=100, temperature=0, stop=["Simple"]
    )
    assert out.choices[0].text.endswith("\n") and "Simple" not in out.choices[0].text
    assert out.choices[0].finish_reason == "stop"


def test_max_tokens_gives_length(client):
    out = client.completions.create(model="zen", prompt="Beautiful is better than", max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3


@pytest.mark.parametrize(
    "body,status",
    [
        ({"model": "zen", "prompt": "x", "temperature": -1}, 400),
        ({"model": "zen", "prompt": "x", "top_p": 0}, 400),
        ({"model": "zen", "prompt": "x", "n": 0}, 400),
        ({"model": "zen", "prompt": ""}, 400),
        ({"model": "zen", "prompt": [10**9]}, 400),
        ({"model": "zen", "prompt": "x", "max_tokens": 10**9}, 400),
        ({"model": "no-such-model", "prompt": "x"}, 404),
        ({"model": "zen", "prompt": 12}, 400),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status):
    code, err = post(server, "/v1/completions", body)
    assert code == status and err["error"]["message"], err


def test_invalid_json_is_400(server):
    code, err = post(server, "/v1/completions", b"{not json", raw=True)
    assert code == 400 and "error" in err


def test_models_retrieve_through_the_client(client):
    openai = pytest.importorskip("openai")
    assert [m.id for m in client.models.list().data] == ["zen"]
    model = client.models.retrieve("zen")
    assert model.id == "zen" and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/other")


def test_tokenize_counts_what_generation_sees_and_detokenize_inverts_it(client, server):
    prompt = "Beautiful is better than"
    out = client.completions.create(model="zen", prompt=prompt, max_tokens=1, temperature=0)
    code, tok = post(server, "/tokenize", {"model": "zen", "prompt": prompt})
    assert code == 200 and tok["count"] == len(tok["tokens"]) == out.usage.prompt_tokens, tok
    code, back = post(server, "/detokenize", {"tokens": tok["tokens"]})
    assert code == 200 and back["prompt"].endswith(prompt), back
    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(model="zen", messages=messages, max_tokens=1, temperature=0)
    code, tok = post(server, "/tokenize", {"messages": messages})
    assert code == 200 and tok["count"] == chat.usage.prompt_tokens, tok
    code, err = post(server, "/detokenize", {"tokens": [10**9]})
    assert code == 400 and "vocabulary" in err["error"]["message"], err


def test_request_ids_reach_the_client(client):
    out = client.completions.create(model="zen", prompt="Flat is", max_tokens=2, temperature=0)
    assert out._request_id and out._request_id.startswith("req-")
    raw = client.completions.with_raw_response.create(
        model="zen", prompt="Flat is", max_tokens=2, temperature=0, extra_headers={"X-Request-Id": "gateway-17"}
    )
    assert raw.headers["x-request-id"] == "gateway-17" and raw.parse().choices[0].text
