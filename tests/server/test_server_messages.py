"""Anthropic's Messages API (/v1/messages) with the official `anthropic` SDK, on the default
model: plain, streamed, stop sequences, forced tool calls, a multi-turn conversation with
tool_use and tool_result, count_tokens, Anthropic-shaped errors and x-api-key. The same
conversation through chat completions renders the same prompt (same tokens, same text)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import pytest

from tests.server.conftest import RunningServer, make_engine, running_server

MODEL = "SmolLM2-135M-Instruct"
KEY = "messages-test-key"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
# The SDK no longer has a temperature argument (its default is 1.0, sampling): greedy here.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    engine = make_engine(None, num_blocks=256, max_model_len=2048)
    with running_server(engine, served_model_name=None, api_key=KEY) as s:
        yield s


def client(server: RunningServer, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def create(server: RunningServer, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", 40)
    return client(server).messages.create(model=MODEL, extra_body=GREEDY, **kwargs)


def test_a_plain_message_is_the_chat_answer_to_the_same_conversation(server):
    message = create(server, system="Answer in one short sentence.")
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == MODEL
    [block] = message.content
    assert block.type == "text" and "Paris" in block.text
    assert message.stop_reason in ("end_turn", "max_tokens")
    chat = server.openai(api_key=KEY).chat.completions.create(
        model=MODEL, max_tokens=40, temperature=0,
        messages=[{"role": "system", "content": "Answer in one short sentence."}, *ASK],
    )  # fmt: skip
    assert block.text == chat.choices[0].message.content
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens


def test_a_stop_sequence_is_named_as_the_stop_reason(server):
    message = create(server, stop_sequences=["Paris"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "Paris"
    assert "Paris" not in message.content[0].text


def test_max_tokens_ends_with_stop_reason_max_tokens(server):
    message = create(server, max_tokens=3)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


def test_a_streamed_message_has_anthropics_events_and_the_same_text(server):
    whole = create(server)
    with client(server).messages.stream(model=MODEL, messages=ASK, max_tokens=40,
                                        extra_body=GREEDY) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def _valid_weather_call(block: Any) -> None:
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.id.startswith("toolu_")
    jsonschema.validate(block.input, WEATHER["input_schema"])


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}],
                         ids=["tool", "any"])  # fmt: skip
def test_a_forced_tool_call_is_a_tool_use_block(server, choice):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    message = create(server, messages=ask, tools=[WEATHER], tool_choice=choice, max_tokens=100)
    assert message.stop_reason == "tool_use", message
    calls = [b for b in message.content if b.type == "tool_use"]
    assert calls
    for block in calls:
        _valid_weather_call(block)
    with client(server).messages.stream(model=MODEL, messages=ask, max_tokens=100,
                                        extra_body=GREEDY, tools=[WEATHER],
                                        tool_choice=choice) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        (b.name, b.input) for b in calls
    ]
    assert streamed.stop_reason == "tool_use"


def test_a_tool_conversation_renders_as_chat_and_turn_two_hits_turn_ones_cache(server):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "tool", "name": "get_weather"}
    first = create(server, messages=ask, tools=[WEATHER], tool_choice=choice, max_tokens=100)
    [call] = [b for b in first.content if b.type == "tool_use"]
    turn_two = [
        *ask,
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees, sunny"},
            {"type": "text", "text": "So, should I take a coat?"}]},
    ]  # fmt: skip
    second = create(server, messages=turn_two, tools=[WEATHER], tool_choice={"type": "none"})
    assert second.content[0].type == "text" and second.content[0].text
    # The turn-1 prompt's full blocks are read from the prefix cache.
    assert second.usage.cache_read_input_tokens >= 16
    counted = client(server).messages.count_tokens(
        model=MODEL, messages=turn_two, tools=[WEATHER], tool_choice={"type": "none"}
    )
    total = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert counted.input_tokens == total
    # The same conversation in chat's form renders the same prompt and answer.
    chat = server.openai(api_key=KEY).chat.completions.create(
        model=MODEL, max_tokens=40, temperature=0, tool_choice="none",
        tools=[{"type": "function", "function": {"name": WEATHER["name"],
                "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}}],
        messages=[*ask,
                  {"role": "assistant", "content": "", "tool_calls": [{
                      "id": call.id, "type": "function", "function": {
                          "name": call.name, "arguments": json.dumps(call.input)}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
                  {"role": "user", "content": "So, should I take a coat?"}],
    )  # fmt: skip
    assert chat.usage.prompt_tokens == total
    assert chat.choices[0].message.content == second.content[0].text


def test_count_tokens_counts_the_rendered_prompt(server):
    message = create(server, system="Be brief.")
    counted = client(server).messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.")
    assert (
        counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    )


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"messages": ASK}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}]}]}, "image"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"messages": [{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "x", "content": "y"}]}]}, "tool_result"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]}, "tool_use"),
    ],
    ids=["no-max-tokens", "image", "unknown-tool", "thinking", "misplaced-tool-result",
         "misplaced-tool-use"],
)  # fmt: skip
def test_bad_input_gets_an_anthropic_shaped_400(server, body, words):
    body = {"model": MODEL, "max_tokens": 10, "messages": ASK, **body}
    if words == "max_tokens":
        del body["max_tokens"]
    response = server.http().post("/v1/messages", json=body, headers={"x-api-key": KEY})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"], error
    assert server.all_blocks_free()


def test_the_sdk_raises_its_own_errors(server):
    with pytest.raises(anthropic.NotFoundError) as not_found:
        client(server).messages.create(model="other-model", messages=ASK, max_tokens=5)
    assert not_found.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as denied:
        client(server, key="wrong").messages.create(model=MODEL, messages=ASK, max_tokens=5)
    assert denied.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": denied.value.body["error"]["message"]}}  # fmt: skip


def test_output_config_format_constrains_the_answer_to_its_schema(server):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}  # fmt: skip
    message = create(server, max_tokens=60,
                     output_config={"format": {"type": "json_schema", "schema": schema}})  # fmt: skip
    jsonschema.validate(json.loads(message.content[0].text), schema)
