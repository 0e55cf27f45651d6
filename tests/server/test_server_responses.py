"""OpenAI's Responses API (/v1/responses) with the official `openai` SDK, on the default
model: plain, streamed, function tools (required and named, streamed and not), text.format
json_schema, follow-ups through previous_response_id (a function_call_output turn), the
store's GET and DELETE, refusals. The same conversation through chat completions renders
the same prompt (same tokens, same text)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from server.responses import ResponsesRequest, conversation_of
from tests.server.conftest import RunningServer, make_engine, running_server

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    engine = make_engine(None, num_blocks=256, max_model_len=2048)
    with running_server(engine, served_model_name=None) as s:
        yield s


def create(server: RunningServer, **kwargs: Any) -> Any:
    kwargs.setdefault("input", QUESTION)
    kwargs.setdefault("max_output_tokens", 40)
    kwargs.setdefault("temperature", 0)
    return server.openai().responses.create(model=MODEL, **kwargs)


def chat(server: RunningServer, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return server.openai().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0, **kwargs
    )


def test_a_plain_response_is_the_chat_answer_to_the_same_conversation(server):
    r = create(server, instructions="Answer in one short sentence.")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status in ("completed", "incomplete")
    [item] = r.output
    assert item.type == "message" and item.role == "assistant"
    expected = chat(server, [{"role": "system", "content": "Answer in one short sentence."},
                             {"role": "user", "content": QUESTION}])  # fmt: skip
    assert r.output_text == expected.choices[0].message.content
    assert r.usage.input_tokens == expected.usage.prompt_tokens
    assert r.usage.output_tokens == expected.usage.completion_tokens


def test_max_output_tokens_makes_it_incomplete(server):
    r = create(server, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_a_streamed_response_sends_the_responses_events_and_the_same_text(server):
    whole = create(server)
    events = list(create(server, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == whole.status.join(["response.", ""])
    for kind in ("response.output_item.added", "response.content_part.added",
                 "response.output_text.delta", "response.output_text.done",
                 "response.output_item.done"):  # fmt: skip
        assert kind in kinds, kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def _weather_calls(r: Any) -> list[Any]:
    calls = [item for item in r.output if item.type == "function_call"]
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    return calls


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}],
                         ids=["required", "named"])  # fmt: skip
def test_function_tools_give_function_call_items_streamed_or_not(server, choice):
    ask = "What is the weather in Paris?"
    r = create(server, input=ask, tools=[WEATHER], tool_choice=choice, max_output_tokens=100)
    calls = _weather_calls(r)
    assert calls and r.status == "completed"
    events = list(create(server, input=ask, tools=[WEATHER], tool_choice=choice,
                         max_output_tokens=100, stream=True))  # fmt: skip
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(c.name, json.loads(c.arguments)) for c in done] == [
        (c.name, json.loads(c.arguments)) for c in calls
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == "".join(c.arguments for c in done)


def test_text_format_json_schema_constrains_the_output(server):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}  # fmt: skip
    r = create(server, max_output_tokens=60,
               text={"format": {"type": "json_schema", "name": "city", "schema": schema}})  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), schema)


def test_a_follow_up_continues_the_stored_conversation_from_its_cache(server):
    ask = "What is the weather in Paris?"
    first = create(server, input=ask, tools=[WEATHER], tool_choice="required",
                   max_output_tokens=100)  # fmt: skip
    [call] = _weather_calls(first)[:1]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18C, sunny"}
    second = create(server, previous_response_id=first.id, input=[result], tools=[WEATHER],
                    tool_choice="none")  # fmt: skip
    assert second.previous_response_id == first.id and second.output_text
    # Turn 2's prompt starts with turn 1's: its full blocks come from the prefix cache.
    assert second.usage.input_tokens_details.cached_tokens >= 16
    # The same conversation sent whole, in chat's form: the same prompt and answer.
    expected = chat(server, [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id,
            "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18C, sunny"},
    ], tools=[{"type": "function", "function": {k: WEATHER[k] for k in
              ("name", "description", "parameters")}}], tool_choice="none")  # fmt: skip
    assert second.usage.input_tokens == expected.usage.prompt_tokens
    assert second.output_text == expected.choices[0].message.content
    # ...and chat's turn finds the conversation the Responses turns cached.
    assert expected.usage.prompt_tokens_details.cached_tokens >= second.usage.input_tokens - 16


def test_stored_responses_can_be_read_and_deleted(server):
    client = server.openai()
    r = create(server)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    assert client.responses.delete(r.id) is None  # the SDK returns nothing on success
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as gone:
        create(server, previous_response_id=r.id)
    assert gone.value.body["param"] == "previous_response_id"
    unstored = create(server, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"background": True}, "background"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        # A reasoning item sent back is taken (tests/server/test_reasoning.py); a malformed
        # one is not.
        ({"input": [{"type": "reasoning", "summary": "not a list"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image",
                                                   "image_url": "http://x/y.png"}]}]}, "input"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ],
    ids=["web-search", "background", "reasoning", "reasoning-item", "image", "truncation",
         "unknown-function"],
)  # fmt: skip
def test_what_is_not_served_is_a_400_naming_it(server, body, param):
    response = server.http().post("/v1/responses",
                                  json={"model": MODEL, "input": QUESTION, **body})  # fmt: skip
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert server.all_blocks_free()


def test_a_follow_up_leaves_the_stored_conversation_as_it_was():
    # A follow-up whose input opens with a call joins it to the stored assistant turn, on
    # a copy: the stored conversation (shared with the store) stays as it was.
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [call]}]  # fmt: skip
    req = ResponsesRequest.model_validate(
        {"input": [{"type": "function_call", "call_id": "call_2", "name": "f", "arguments": "{}"}]}
    )
    messages = conversation_of(req, history)
    assert [c["id"] for c in messages[-1]["tool_calls"]] == ["call_1", "call_2"]
    assert history[-1]["tool_calls"] == [call]
