"""The Responses API (POST /v1/responses) end to end: a real `nsaserve serve` with GLM-5's
reasoning and tool-call parsers, its output forced by the test-only scripted executor, seen
through the official `openai` client's `responses.create` and `responses.stream` (whose event
accumulator checks the event sequence and rebuilds the final response).

Each test registers the exact text the "model" emits (GLM-5's markup), then checks the output
items the client gets (reasoning, message, function calls), `output_text`, usage, the stream,
a tool-result turn rendered back into the next prompt as chat completions renders it, and
structured output.
"""

from __future__ import annotations

import json

import pytest
from glm_model_dir import WEATHER_CALL, WEATHER_PARAMETERS
from scripted_replies import Script

openai = pytest.importorskip("openai")

# The GLM-5 server and its client: the fixtures glm_dir, script, server and client.
pytest_plugins = ["glm_parser_server"]

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather forecast for a city.",
    "parameters": WEATHER_PARAMETERS,
}


def only_prompt(script: Script, marker: str) -> str:
    records = script.prompts(marker)
    assert len(records) == 1, records
    return records[0]["prompt_text"]


def test_reasoning_and_answer(client, script):
    marker = script.reply("The user greets me.</think>Hello there!")
    out = client.responses.create(model="glm", input=f"hi {marker}", temperature=0)
    assert out.status == "completed" and out.object == "response" and out.id.startswith("resp_")
    assert [item.type for item in out.output] == ["reasoning", "message"]
    assert out.output[0].content[0].text == "The user greets me."
    assert out.output_text == "Hello there!"
    assert out.usage.output_tokens > out.usage.output_tokens_details.reasoning_tokens > 0
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert only_prompt(script, marker).endswith("<|assistant|><think>")


def test_instructions_are_the_system_turn(client, script):
    marker = script.reply("Fine.</think>Ok.")
    out = client.responses.create(model="glm", instructions="Answer in one word.", input=f"go {marker}")
    assert out.output_text == "Ok." and out.instructions == "Answer in one word."
    assert "<|system|>Answer in one word.<|user|>go " in only_prompt(script, marker)


def test_a_call_then_its_result(client, script):
    marker = script.reply(f"Need the weather.</think>{WEATHER_CALL}")
    first = client.responses.create(model="glm", input=f"Weather in Paris? {marker}", tools=[WEATHER])
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3}
    assert calls[0].call_id.startswith("call_") and first.status == "completed"

    # The next turn sends everything back (nothing is stored), with the call's result.
    answer = script.reply("Sunny it is.</think>It will be sunny.")
    follow = [
        {"role": "user", "content": f"Weather in Paris? {answer}"},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21C"},
    ]
    second = client.responses.create(model="glm", input=follow, tools=[WEATHER])
    assert second.output_text == "It will be sunny."
    prompt = only_prompt(script, answer)
    assert "<think>Need the weather.</think>" in prompt and "<tool_call>get_weather" in prompt
    assert prompt.endswith("<|observation|><tool_response>sunny, 21C</tool_response><|assistant|><think>")


def test_streamed_through_the_clients_accumulator(client, script):
    thinking = "Step one: read the question. Step two: answer it."
    marker = script.reply(f"{thinking}</think>Here is the answer, piece by piece.{WEATHER_CALL}")
    kinds = []
    with client.responses.stream(model="glm", input=f"stream {marker}", tools=[WEATHER]) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.reasoning_text.delta") > 3 and kinds.count("response.output_text.delta") > 3
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == thinking
    assert final.output_text == "Here is the answer, piece by piece."
    assert json.loads(final.output[2].arguments) == {"city": "Paris", "days": 3}
    assert [e for e in kinds if e.endswith(".done")].count("response.output_item.done") == 3


def test_max_output_tokens_cut_is_incomplete(client, script):
    marker = script.reply("Let me think about this for a long while before answering.</think>Done.")
    out = client.responses.create(model="glm", input=f"long {marker}", max_output_tokens=4)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 4 and [item.type for item in out.output] == ["reasoning"]


def test_structured_output_through_text_format(client, script):
    marker = script.reply('Plan.</think>{"city": "Paris"}')
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    out = client.responses.create(
        model="glm",
        input=f"json {marker}",
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
    )
    assert json.loads(out.output_text) == {"city": "Paris"}
    assert out.text.format.type == "json_schema"


def test_what_needs_stored_responses_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="glm", input="x", previous_response_id="resp_123")
    assert "stores no responses" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="glm", input=[{"type": "item_reference", "id": "msg_1"}])
