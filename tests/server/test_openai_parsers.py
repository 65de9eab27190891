"""GLM-5 chat end to end: a real `nsaserve serve` (router and worker processes) with
`--reasoning-parser glm45 --tool-call-parser glm47`, its model output forced by the test-only
scripted executor, seen through the official `openai` client.

Each test registers the exact text the "model" emits (GLM-5's markup), then checks what the
client gets: reasoning_content and content, tool_calls with arguments typed by the tool's schema,
the same through streaming deltas, tool_choice, the tool-result turn rendered back into the next
prompt (read from the worker's record, and compared with Hugging Face's rendering of the same
template), and malformed markup returned as content and counted in /metrics.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import pytest
from scripted_replies import Script, start_scripted_server

openai = pytest.importorskip("openai")

# The GLM-5 server and its client: the fixtures glm_dir, script, server and client.
pytest_plugins = ["glm_parser_server"]
from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "zip": {"type": "string"},
                "options": {"type": "object"},
            },
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
}
TOOLS = [WEATHER, CLOCK]

WEATHER_CALL = (
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
    "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>metric</arg_key><arg_value>true</arg_value>"
    "<arg_key>zip</arg_key><arg_value>007</arg_value>"
    '<arg_key>options</arg_key><arg_value>{"hourly": [1, 2], "units": "C"}</arg_value></tool_call>'
)
WEATHER_ARGS = {"city": "Paris", "days": 3, "metric": True, "zip": "007", "options": {"hourly": [1, 2], "units": "C"}}

def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def reasoning_of(obj) -> str | None:
    return (obj.model_extra or {}).get("reasoning_content")


def fallbacks(server, parser: str = "glm47") -> int:
    status, body = server.get("/metrics")
    assert status == 200
    found = re.search(rf'^nsaserve_parser_fallbacks_total{{parser="{parser}"}} (\d+)$', body.decode(), re.M)
    return int(found.group(1)) if found else 0


def forced_choices(server) -> int:
    """Requests whose forced tool_choice became a grammar, from /metrics."""
    status, body = server.get("/metrics")
    assert status == 200
    found = re.search(r'^nsaserve_structured_output_requests_total{kind="tool_call"} (\d+)$', body.decode(), re.M)
    return int(found.group(1)) if found else 0


def only_prompt(script: Script, marker: str) -> str:
    records = script.prompts(marker)
    assert len(records) == 1, records
    return records[0]["prompt_text"]


def hf_render(glm_dir, messages, **kwargs) -> str:
    """The same template rendered by Hugging Face (Jinja2), as other servers would."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(glm_dir))
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def streamed(client, **kwargs):
    """(chunks, the completion the openai client's accumulator rebuilds from them)."""
    state = ChatCompletionStreamState()
    chunks = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        chunks.append(chunk)
        state.handle_chunk(chunk)
    return chunks, state.get_final_completion()


# ------------------------------------------------------------------ reasoning


def test_reasoning_then_answer(client, script, glm_dir):
    marker = script.reply("The user greets me; answer briefly.</think>Hello there!")
    messages = user(f"hi {marker}")
    out = client.chat.completions.create(model="glm", messages=messages, temperature=0)
    msg = out.choices[0].message
    assert reasoning_of(msg) == "The user greets me; answer briefly."
    assert msg.content == "Hello there!" and not msg.tool_calls
    assert out.choices[0].finish_reason == "stop"
    # The prompt the worker ran is the template's, opening the thinking, as Jinja2 renders it.
    prompt = only_prompt(script, marker)
    assert prompt.endswith("<|assistant|><think>")
    assert prompt == hf_render(glm_dir, messages)


def test_reasoning_streamed_as_deltas(client, script):
    thinking = "Step one: read the question. Step two: count the letters in it carefully."
    answer = "There are seven letters, counted one by one."
    marker = script.reply(f"{thinking}</think>{answer}")
    chunks, final = streamed(client, model="glm", messages=user(f"count {marker}"), temperature=0)
    kinds = []
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        if reasoning_of(d):
            kinds.append("r")
        if d.content:
            kinds.append("c")
    # Incremental: many pieces, every thinking piece before any answer piece.
    assert kinds.count("r") > 3 and kinds.count("c") > 3
    assert "".join(kinds) == "r" * kinds.count("r") + "c" * kinds.count("c")
    msg = final.choices[0].message
    assert reasoning_of(msg) == thinking and msg.content == answer
    assert final.choices[0].finish_reason == "stop"


def test_thinking_disabled_by_template_kwargs(client, script, glm_dir):
    marker = script.reply("Just the answer.")
    messages = user(f"quick {marker}")
    out = client.chat.completions.create(
        model="glm", messages=messages, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    msg = out.choices[0].message
    assert msg.content == "Just the answer." and reasoning_of(msg) is None
    prompt = only_prompt(script, marker)
    assert prompt.endswith("<|assistant|></think>") and prompt == hf_render(glm_dir, messages, enable_thinking=False)


def test_max_tokens_cuts_inside_the_thinking(client, script):
    thinking = "Let me think about this for a long while before answering anything."
    marker = script.reply(f"{thinking}</think>Done.")
    out = client.chat.completions.create(model="glm", messages=user(f"long {marker}"), temperature=0, max_tokens=5)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    assert len(reasoning_of(msg)) > 3 and thinking.startswith(reasoning_of(msg)) and reasoning_of(msg) != thinking
    assert not msg.content


def test_logprobs_come_from_the_sampler(client, script):
    marker = script.reply("Short.</think>Yes.")
    out = client.chat.completions.create(
        model="glm", messages=user(f"lp {marker}"), temperature=1.0, seed=7, logprobs=True, top_logprobs=2
    )
    entries = out.choices[0].logprobs.content
    # Every generated token but the closing EOS (counted in usage, with no text) has an entry.
    assert "".join(e.token for e in entries) == "Short.</think>Yes." and len(entries) == out.usage.completion_tokens - 1
    for e in entries:
        # The scripted token has all the probability mass; its first alternative is itself.
        assert e.logprob > -1e-6 and len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[1].logprob < -40


def test_completions_endpoint_returns_the_raw_markup(client, script):
    marker = script.reply("raw</think>" + WEATHER_CALL)
    out = client.completions.create(
        model="glm", prompt=f"[gMASK]<sop><|user|>{marker}<|assistant|><think>", max_tokens=200, temperature=0
    )
    assert out.choices[0].text == "raw</think>" + WEATHER_CALL


# ------------------------------------------------------------------ tool calls


def test_tool_call_with_typed_arguments(client, script, glm_dir):
    # GLM ends a turn that calls tools with <|observation|>, a stop token: nothing after it is generated.
    marker = script.reply(f"Need the forecast.</think>Checking.{WEATHER_CALL}<|observation|>never generated")
    messages = user(f"weather in Paris? {marker}")
    out = client.chat.completions.create(model="glm", messages=messages, tools=TOOLS, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert reasoning_of(choice.message) == "Need the forecast." and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == WEATHER_ARGS
    prompt = only_prompt(script, marker)
    assert "<tools>\n" in prompt and '"name": "get_time"' in prompt
    assert prompt == hf_render(glm_dir, messages, tools=TOOLS)


def test_tool_calls_streamed_and_reassembled(client, script):
    text = f"Two lookups.</think>{WEATHER_CALL}\n<tool_call>get_time<arg_key>tz</arg_key><arg_value>UTC</arg_value></tool_call>"
    marker = script.reply(text)
    kwargs = dict(model="glm", messages=user(f"both {marker}"), tools=TOOLS, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks, final = streamed(client, **kwargs)
    deltas = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    # Each call opens with its index, id, type and name, then its arguments follow.
    openers = [d for d in deltas if d.id]
    assert [d.index for d in openers] == [0, 1] and all(d.type == "function" for d in openers)
    assert [d.function.name for d in openers] == ["get_weather", "get_time"]
    assert final.choices[0].finish_reason == "tool_calls" == whole.choices[0].finish_reason
    got = [(c.function.name, json.loads(c.function.arguments)) for c in final.choices[0].message.tool_calls]
    assert got == [("get_weather", WEATHER_ARGS), ("get_time", {"tz": "UTC"})]
    assert got == [(c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls]
    assert reasoning_of(final.choices[0].message) == "Two lookups." and not final.choices[0].message.content


def test_tool_choice_none_keeps_markup_as_content(client, script):
    marker = script.reply(f"No tools now.</think>{WEATHER_CALL}")
    out = client.chat.completions.create(
        model="glm", messages=user(f"none {marker}"), tools=TOOLS, tool_choice="none", temperature=0
    )
    msg = out.choices[0].message
    assert not msg.tool_calls and msg.content == WEATHER_CALL and out.choices[0].finish_reason == "stop"
    assert '"name": "get_weather"' in only_prompt(script, marker)  # the tools were still shown


def test_tool_choice_required(client, script):
    marker = script.reply(
        "Must call.</think><tool_call>get_time<arg_key>tz</arg_key><arg_value>CET</arg_value></tool_call>"
    )
    out = client.chat.completions.create(
        model="glm", messages=user(f"req {marker}"), tools=TOOLS, tool_choice="required", temperature=0
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"tz": "CET"}


def test_tool_choice_required_steers_an_answer_in_words_into_a_call(client, script, server):
    """The "model" wants to answer in words; the forced choice's grammar masks every token that
    is not the start of a call, so the sampler (greedy over what the mask leaves) writes one."""
    marker = script.reply("No tool needed.</think>It is sunny in Paris today, enjoy!")
    before = forced_choices(server)
    out = client.chat.completions.create(
        model="glm", messages=user(f"words {marker}"), tools=TOOLS, tool_choice="required",
        temperature=0, max_tokens=80,
    )  # fmt: skip
    choice = out.choices[0]
    assert reasoning_of(choice.message) == "No tool needed."
    assert "sunny" not in (choice.message.content or "")
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls and not choice.message.content
        assert {c.function.name for c in choice.message.tool_calls} <= {"get_weather", "get_time"}
    else:  # cut inside a call's free-text value: the unfinished markup comes back as content
        assert choice.finish_reason == "length" and choice.message.content.startswith("<tool_call>get_")
    assert forced_choices(server) == before + 1


def test_tool_choice_named_shows_and_allows_only_that_tool(client, script):
    named = {"type": "function", "function": {"name": "get_weather"}}
    marker = script.reply(f"Forecast.</think>{WEATHER_CALL}")
    out = client.chat.completions.create(
        model="glm", messages=user(f"named {marker}"), tools=TOOLS, tool_choice=named, temperature=0
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == WEATHER_ARGS
    prompt = only_prompt(script, marker)
    assert '"name": "get_weather"' in prompt and "get_time" not in prompt
    # The "model" calls a tool the choice excludes: the grammar lets it write only get_weather.
    other = "<tool_call>get_time<arg_key>tz</arg_key><arg_value>UTC</arg_value></tool_call>"
    marker = script.reply(f"Wrong tool.</think>{other}")
    out = client.chat.completions.create(
        model="glm", messages=user(f"named {marker}"), tools=TOOLS, tool_choice=named, temperature=0,
        max_tokens=60,
    )  # fmt: skip
    msg = out.choices[0].message
    assert "get_time" not in (msg.content or "")
    assert all(c.function.name == "get_weather" for c in msg.tool_calls or [])
    assert (msg.content or "").startswith("<tool_call>get_weather") or msg.tool_calls


def test_parallel_tool_calls_false_allows_one_call(client, script):
    two = f"{WEATHER_CALL}<tool_call>get_time<arg_key>tz</arg_key><arg_value>CET</arg_value></tool_call>"
    marker = script.reply(f"Both.</think>{two}")
    kwargs = dict(model="glm", messages=user(f"two {marker}"), tools=TOOLS, temperature=0)
    assert len(client.chat.completions.create(**kwargs).choices[0].message.tool_calls) == 2
    for choice in ("auto", "required"):
        out = client.chat.completions.create(**kwargs, tool_choice=choice, parallel_tool_calls=False)
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == WEATHER_ARGS
        assert out.choices[0].finish_reason == "tool_calls"


def test_tool_result_is_rendered_into_the_next_turn(client, script, glm_dir):
    marker = script.reply(f"Need data.</think>{WEATHER_CALL}")
    messages = user(f"plan a picnic {marker}")
    first = (
        client.chat.completions.create(model="glm", messages=messages, tools=TOOLS, temperature=0).choices[0].message
    )
    (call,) = first.tool_calls
    answer = script.reply("It will be sunny.</think>Go on Saturday: 21 C and sunny.")
    follow_up = messages + [
        first.model_dump(exclude_none=True, exclude={"reasoning_content"}),
        {"role": "tool", "tool_call_id": call.id, "content": f'{{"temp": 21, "sky": "sunny", "ref": "{answer}"}}'},
    ]
    out = client.chat.completions.create(model="glm", messages=follow_up, tools=TOOLS, temperature=0)
    assert out.choices[0].message.content == "Go on Saturday: 21 C and sunny."
    prompt = only_prompt(script, answer)
    # The call went back as OpenAI sends it (arguments as a JSON string) and was rendered as
    # GLM writes it, each value typed as the model wrote it.
    call_markup = re.search(
        r"<\|assistant\|></think>(<tool_call>.*?</tool_call>)<\|observation\|><tool_response>", prompt
    )
    assert call_markup, prompt
    for pair in (
        "city</arg_key><arg_value>Paris<",
        "days</arg_key><arg_value>3<",
        "metric</arg_key><arg_value>true<",
        "zip</arg_key><arg_value>007<",
    ):
        assert f"<arg_key>{pair}" in call_markup.group(1)
    assert prompt.endswith(f'"ref": "{answer}"}}</tool_response><|assistant|><think>')
    # Hugging Face renders the same turn (arguments as a mapping, as its templates expect).
    hf_messages = [dict(m) for m in follow_up]
    hf_messages[1] = {
        "role": "assistant",
        "content": hf_messages[1].get("content"),
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.loads(call.function.arguments)},
            }
        ],
    }
    assert prompt == hf_render(glm_dir, hf_messages, tools=TOOLS)


def test_malformed_markup_degrades_to_content_and_is_counted(client, script, server):
    broken = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"  # never closed
    marker = script.reply(f"Trying.</think>Let me see. {broken}")
    before = fallbacks(server)
    out = client.chat.completions.create(model="glm", messages=user(f"bad {marker}"), tools=TOOLS, temperature=0)
    msg = out.choices[0].message
    assert msg.content == f"Let me see. {broken}" and not msg.tool_calls and out.choices[0].finish_reason == "stop"
    assert fallbacks(server) == before + 1
    chunks, final = streamed(client, model="glm", messages=user(f"bad {marker}"), tools=TOOLS, temperature=0)
    assert final.choices[0].message.content == f"Let me see. {broken}" and not final.choices[0].message.tool_calls
    assert fallbacks(server) == before + 2


def test_concurrent_conversations_each_get_their_own_output(client, script):
    """Batched steps: replies of different shapes, streamed and not, in flight together."""
    cases = []
    for i in range(8):
        if i % 2:
            text = f"Case {i} thinks.</think><tool_call>get_time<arg_key>tz</arg_key><arg_value>UTC+{i}</arg_value></tool_call>"
            want = (f"Case {i} thinks.", None, [("get_time", {"tz": f"UTC+{i}"})])
        else:
            text = f"Case {i} thinks{' hard' * i}.</think>Answer {i}."
            want = (f"Case {i} thinks{' hard' * i}.", f"Answer {i}.", [])
        cases.append((script.reply(text), i % 4 < 2, want))

    def run(case):
        marker, stream, want = case
        kwargs = dict(model="glm", messages=user(f"go {marker}"), tools=TOOLS, temperature=0)
        out = streamed(client, **kwargs)[1] if stream else client.chat.completions.create(**kwargs)
        msg = out.choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
        return (reasoning_of(msg), msg.content or None, calls), want

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for got, want in pool.map(run, cases):
            assert got == want


# ------------------------------------------------------------------ DeepSeek-V3.2 markup

DSML_CALL = (
    '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">杭州</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜function_calls>"
)


@pytest.fixture(scope="module")
def deepseek_client(script, glm_dir):
    s = start_scripted_server(
        script, glm_dir, "--served-model-name=ds", "--reasoning-parser=deepseek-r1", "--tool-call-parser=deepseekv32"
    )
    yield openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert s.stop() == 0


def test_deepseek_v32_calls_and_r1_reasoning(deepseek_client, script):
    marker = script.reply(f"Check the city.</think>\n\n{DSML_CALL}")
    kwargs = dict(model="ds", messages=user(f"ds {marker}"), tools=TOOLS, temperature=0)
    whole = deepseek_client.chat.completions.create(**kwargs)
    _, final = streamed(deepseek_client, **kwargs)
    # Forced: the DSML markup is what the grammar allows, so the same calls come back.
    forced = deepseek_client.chat.completions.create(**kwargs, tool_choice="required")
    for out in (whole, final, forced):
        msg = out.choices[0].message
        assert reasoning_of(msg) == "Check the city." and not msg.content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
            ("get_weather", {"city": "杭州", "days": 2})
        ]
        assert out.choices[0].finish_reason == "tool_calls"
