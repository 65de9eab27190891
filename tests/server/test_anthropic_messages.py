"""Anthropic's Messages API (POST /v1/messages) end to end: a real `nsaserve serve` with GLM-5's
reasoning and tool-call parsers, its output forced by the test-only scripted executor, seen
through Anthropic's official `anthropic` client: `messages.create`, and `messages.stream`,
whose accumulator rebuilds the final message from the events.

Each test registers the exact text the "model" emits (GLM-5's markup), then checks the content
blocks the client gets (thinking, text, tool_use with a typed input), the stop reason and usage,
a tool-result turn rendered back into the next prompt, the thinking switch, errors and the API
key sent as `x-api-key`.
"""

from __future__ import annotations

import pytest
from glm_model_dir import WEATHER_CALL, WEATHER_PARAMETERS
from scripted_replies import Script

anthropic = pytest.importorskip("anthropic")

# The GLM-5 server: the fixtures glm_dir, script and server.
pytest_plugins = ["glm_parser_server"]

WEATHER = {
    "name": "get_weather",
    "description": "Weather forecast for a city.",
    "input_schema": WEATHER_PARAMETERS,
}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def only_prompt(script: Script, marker: str) -> str:
    records = script.prompts(marker)
    assert len(records) == 1, records
    return records[0]["prompt_text"]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_thinking_then_answer(claude, script):
    marker = script.reply("The user greets me.</think>Hello there!")
    out = claude.messages.create(model="glm", max_tokens=100, messages=user(f"hi {marker}"), system="Be kind.")
    assert [block.type for block in out.content] == ["thinking", "text"]
    assert out.content[0].thinking == "The user greets me." and out.content[1].text == "Hello there!"
    assert out.stop_reason == "end_turn" and out.role == "assistant" and out.id.startswith("msg_")
    assert out.usage.output_tokens > 0 and out.usage.input_tokens + out.usage.cache_read_input_tokens > 0
    assert only_prompt(script, marker).startswith("[gMASK]<sop><|system|>Be kind.<|user|>hi ")


def test_tool_use_then_its_result(claude, script):
    marker = script.reply(f"Need the weather.</think>{WEATHER_CALL}")
    first = claude.messages.create(model="glm", max_tokens=100, tools=[WEATHER], messages=user(f"Paris? {marker}"))
    assert first.stop_reason == "tool_use"
    call = first.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris", "days": 3}

    answer = script.reply("Sunny.</think>It will be sunny.")
    messages = [
        {"role": "user", "content": f"Paris? {answer}"},
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21C"}]},
    ]
    second = claude.messages.create(model="glm", max_tokens=100, tools=[WEATHER], messages=messages)
    assert second.content[-1].text == "It will be sunny."
    prompt = only_prompt(script, answer)
    assert "<think>Need the weather.</think><tool_call>get_weather" in prompt
    assert prompt.endswith("<|observation|><tool_response>sunny, 21C</tool_response><|assistant|><think>")


def test_streamed_through_the_clients_accumulator(claude, script):
    thinking = "Step one: read the question. Step two: answer it."
    marker = script.reply(f"{thinking}</think>Here is the answer, piece by piece.{WEATHER_CALL}")
    kinds = []
    with claude.messages.stream(model="glm", max_tokens=200, tools=[WEATHER], messages=user(f"s {marker}")) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [block.type for block in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == thinking
    assert final.content[1].text == "Here is the answer, piece by piece."
    assert final.content[2].input == {"city": "Paris", "days": 3}
    assert final.stop_reason == "tool_use" and final.usage.output_tokens > 0


def test_thinking_disabled_and_stop_sequences(claude, script):
    marker = script.reply("Plain answer STOP and more.")
    out = claude.messages.create(
        model="glm",
        max_tokens=50,
        messages=user(f"quick {marker}"),
        thinking={"type": "disabled"},
        stop_sequences=["STOP"],
    )
    assert only_prompt(script, marker).endswith("<|assistant|></think>")
    assert [block.type for block in out.content] == ["text"] and out.content[0].text == "Plain answer "
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == "STOP"


def test_max_tokens_cut(claude, script):
    marker = script.reply("Let me think about this for a long while before answering.</think>Done.")
    out = claude.messages.create(model="glm", max_tokens=4, messages=user(f"long {marker}"))
    assert out.stop_reason == "max_tokens" and out.usage.output_tokens == 4
    assert [block.type for block in out.content] == ["thinking"]


def test_count_tokens(claude, script):
    marker = script.reply("Counted.</think>Yes.")
    messages = user(f"count {marker}")
    counted = claude.messages.count_tokens(model="glm", system="Be brief.", messages=messages, tools=[WEATHER])
    out = claude.messages.create(model="glm", max_tokens=20, system="Be brief.", messages=messages, tools=[WEATHER])
    assert counted.input_tokens == out.usage.input_tokens + out.usage.cache_read_input_tokens > 0


def test_errors_are_anthropics(claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="glm", max_tokens=5, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]
        )
    assert e.value.body["error"]["type"] == "invalid_request_error" and "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-opus", max_tokens=5, messages=user("x"))


def test_the_api_key_as_x_api_key(script, glm_dir):
    from scripted_replies import start_scripted_server

    server = start_scripted_server(script, glm_dir, "--served-model-name=glm", "--api-key=sesame")
    try:
        marker = script.reply("Hi.")
        ok = anthropic.Anthropic(base_url=server.base_url, api_key="sesame", max_retries=0, timeout=60)
        assert ok.messages.create(model="glm", max_tokens=5, messages=user(marker)).content[0].text == "Hi."
        wrong = anthropic.Anthropic(base_url=server.base_url, api_key="nope", max_retries=0, timeout=60)
        with pytest.raises(anthropic.AuthenticationError):
            wrong.messages.create(model="glm", max_tokens=5, messages=user("x"))
    finally:
        assert server.stop() == 0
