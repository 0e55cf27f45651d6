"""Agent loops with the official SDKs on the default model: each API runs the loop agent
clients run, tools on every turn, tool_choice left at its default.

SmolLM2-135M-Instruct's chat template has no place for tools, so these run through the
generic tool format (server/generic_tools.py). What the model chooses with tool_choice
"auto" (a call or a reply) is its own affair; the tests assert that the protocol holds
either way: a call is well-formed and parsed into the API's call shape, a reply is text,
and the next turn takes the tool's results and is answered. Turn one asks for a call
("required" / "any") so that a call and its result are really in the loop; turns two and
three leave tool_choice unset. Each loop runs whole and streamed (greedy: both must see
the same turns).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import pytest

from tests.server.conftest import RunningServer, make_engine, running_server

MODEL = "SmolLM2-135M-Instruct"
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
DESCRIPTION = "The current weather in a city."
CHAT_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": DESCRIPTION, "parameters": PARAMETERS}}  # fmt: skip
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": DESCRIPTION,
                  "parameters": PARAMETERS}  # fmt: skip
MESSAGES_TOOL = {"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMETERS}
ASK = "What is the weather in Paris?"
RESULT = '{"city": "Paris", "temperature_c": 18, "sky": "sunny"}'
FOLLOW_UP = "Thanks. Should I take a coat?"
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    engine = make_engine(None, num_blocks=256, max_model_len=2048)
    with running_server(engine, served_model_name=None) as s:
        yield s


def _valid_arguments(name: str, arguments: Any) -> None:
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments,
                        PARAMETERS)  # fmt: skip


# ------------------------------------------------------------------- chat completions


def _chat_turn(server: RunningServer, messages: list, stream: bool, **kwargs: Any) -> dict:
    """One chat turn as {content, calls: [{id, name, arguments}], finish}, whole or streamed."""
    client = server.openai()
    args = {"model": MODEL, "messages": messages, "tools": [CHAT_TOOL], "temperature": 0,
            "max_tokens": MAX_TOKENS, **kwargs}  # fmt: skip
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or ()]  # fmt: skip
        return {"content": choice.message.content or "", "calls": calls,
                "finish": choice.finish_reason}  # fmt: skip
    calls: dict[int, dict[str, str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += d.id or ""
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


def _check_chat_turn(turn: dict) -> None:
    """A turn is well-formed calls (finish "tool_calls") or a reply, never a broken call."""
    for call in turn["calls"]:
        assert call["id"].startswith("call_")
        _valid_arguments(call["name"], call["arguments"])
    if turn["calls"]:
        assert turn["finish"] == "tool_calls", turn
    else:
        assert turn["content"] and "<tool_call>" not in turn["content"], turn
        assert turn["finish"] in ("stop", "length"), turn


def _chat_next(messages: list, turn: dict) -> list:
    """The conversation after `turn`: its calls answered, or the user's follow-up."""
    calls = [{"id": c["id"], "type": "function",
              "function": {"name": c["name"], "arguments": c["arguments"]}}
             for c in turn["calls"]]  # fmt: skip
    if not calls:
        return [*messages, {"role": "assistant", "content": turn["content"]},
                {"role": "user", "content": FOLLOW_UP}]  # fmt: skip
    results = [{"role": "tool", "tool_call_id": c["id"], "content": RESULT} for c in calls]
    return [*messages, {"role": "assistant", "content": turn["content"] or None,
                        "tool_calls": calls}, *results]  # fmt: skip


def _chat_loop(server: RunningServer, stream: bool) -> list[dict]:
    messages: list = [{"role": "user", "content": ASK}]
    turns = [_chat_turn(server, messages, stream, tool_choice="required")]
    assert turns[0]["calls"] and turns[0]["finish"] == "tool_calls", turns[0]
    for _ in range(2):  # the tool's result, then whatever comes next: tool_choice unset
        messages = _chat_next(messages, turns[-1])
        turns.append(_chat_turn(server, messages, stream))
    for turn in turns:
        _check_chat_turn(turn)
    return turns


def test_chat_completions_tool_loop_with_default_tool_choice(server):
    whole = _chat_loop(server, stream=False)
    streamed = _chat_loop(server, stream=True)

    def key(t: dict) -> tuple:
        return t["content"], [(c["name"], c["arguments"]) for c in t["calls"]], t["finish"]

    assert [key(t) for t in streamed] == [key(t) for t in whole]


def test_auto_on_turn_one_is_a_reply_or_a_well_formed_call(server):
    """tool_choice "auto" said outright, and left out: the same answer, streamed or not."""
    messages = [{"role": "user", "content": ASK}]
    turns = [_chat_turn(server, messages, stream, **extra)
             for stream in (False, True) for extra in ({}, {"tool_choice": "auto"})]  # fmt: skip
    for turn in turns:
        _check_chat_turn(turn)
    assert all(t["content"] == turns[0]["content"] for t in turns), turns


# ----------------------------------------------------------------------------- Responses


def _responses_turn(server: RunningServer, stream: bool, **kwargs: Any) -> Any:
    """One Responses turn: the Response (for a stream, the one its completed event carries)."""
    client = server.openai()
    args = {"model": MODEL, "tools": [RESPONSES_TOOL], "temperature": 0,
            "max_output_tokens": MAX_TOKENS, **kwargs}  # fmt: skip
    if not stream:
        return client.responses.create(**args)
    events = list(client.responses.create(stream=True, **args))
    assert events[-1].type == "response.completed", events[-1]
    return events[-1].response


def _check_response(r: Any) -> list[Any]:
    """A completed response of well-formed function calls or a message; its calls."""
    assert r.status in ("completed", "incomplete"), r
    calls = [item for item in r.output if item.type == "function_call"]
    for call in calls:
        assert call.call_id.startswith("call_")
        _valid_arguments(call.name, call.arguments)
    if not calls:
        assert r.output_text and "<tool_call>" not in r.output_text, r
    return calls


def _responses_loop(server: RunningServer, stream: bool) -> list[Any]:
    ask = {"role": "user", "content": ASK}
    first = _responses_turn(server, stream, input=[ask], tool_choice="required")
    calls = _check_response(first)
    assert calls, first
    # Turn two sends the whole conversation back as items, as stateless agents do ...
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": RESULT}
               for c in calls]  # fmt: skip
    history = [ask, *[c.model_dump(exclude_none=True) for c in calls], *outputs]
    second = _responses_turn(server, stream, input=history)
    more = _check_response(second)
    # ... turn three continues the stored one by its id.
    follow = ([{"type": "function_call_output", "call_id": c.call_id, "output": RESULT}
               for c in more] or FOLLOW_UP)  # fmt: skip
    third = _responses_turn(server, stream, input=follow, previous_response_id=second.id)
    _check_response(third)
    return [first, second, third]


def test_responses_tool_loop_with_default_tool_choice(server):
    whole = _responses_loop(server, stream=False)
    streamed = _responses_loop(server, stream=True)

    def key(r: Any) -> tuple:
        calls = [(i.name, i.arguments) for i in r.output if i.type == "function_call"]
        return r.output_text, calls

    assert [key(r) for r in streamed] == [key(r) for r in whole]


def test_a_structured_final_answer_after_the_tool_result(server):
    """Tools and a text.format together (the Agents SDK's output_type): the answer is
    well-formed calls or JSON of that schema."""
    schema = {"type": "object", "properties": {"take_coat": {"type": "boolean"}},
              "required": ["take_coat"], "additionalProperties": False}  # fmt: skip
    ask = {"role": "user", "content": ASK}
    first = _responses_turn(server, False, input=[ask], tool_choice="required")
    calls = _check_response(first)
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": RESULT}
               for c in calls]  # fmt: skip
    history = [ask, *[c.model_dump(exclude_none=True) for c in calls], *outputs,
               {"role": "user", "content": FOLLOW_UP}]  # fmt: skip
    fmt = {"format": {"type": "json_schema", "name": "advice", "schema": schema}}
    for stream in (False, True):
        r = _responses_turn(server, stream, input=history, text=fmt)
        if not _check_response(r):
            jsonschema.validate(json.loads(r.output_text), schema)


# ------------------------------------------------------------------- Anthropic Messages


def _messages_turn(server: RunningServer, stream: bool, **kwargs: Any) -> Any:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                                 timeout=60)  # fmt: skip
    args = {"model": MODEL, "tools": [MESSAGES_TOOL], "max_tokens": MAX_TOKENS,
            "extra_body": {"temperature": 0}, **kwargs}  # fmt: skip
    if not stream:
        return client.messages.create(**args)
    with client.messages.stream(**args) as events:
        return events.get_final_message()


def _check_message(message: Any) -> list[Any]:
    """tool_use blocks that are well-formed calls (stop_reason tool_use) or a text reply."""
    uses = [b for b in message.content if b.type == "tool_use"]
    for block in uses:
        assert block.id.startswith("toolu_")
        _valid_arguments(block.name, block.input)
    if uses:
        assert message.stop_reason == "tool_use", message
    else:
        text = "".join(b.text for b in message.content if b.type == "text")
        assert text and "<tool_call>" not in text, message
        assert message.stop_reason in ("end_turn", "max_tokens"), message
    return uses


def _messages_next(messages: list, message: Any) -> list:
    """The conversation after `message`: its tool_use blocks answered, or a follow-up."""
    uses = [b for b in message.content if b.type == "tool_use"]
    reply = {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                              for b in message.content]}  # fmt: skip
    if not uses:
        return [*messages, reply, {"role": "user", "content": FOLLOW_UP}]
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": RESULT} for b in uses]
    return [*messages, reply, {"role": "user", "content": results}]


def _messages_loop(server: RunningServer, stream: bool) -> list[Any]:
    messages: list = [{"role": "user", "content": ASK}]
    turns = [_messages_turn(server, stream, messages=messages, tool_choice={"type": "any"})]
    assert _check_message(turns[0]), turns[0]
    for _ in range(2):  # the tool's result, then whatever comes next: tool_choice unset
        messages = _messages_next(messages, turns[-1])
        turns.append(_messages_turn(server, stream, messages=messages))
        _check_message(turns[-1])
    return turns


def test_anthropic_messages_tool_loop_with_default_tool_choice(server):
    whole = _messages_loop(server, stream=False)
    streamed = _messages_loop(server, stream=True)

    def key(m: Any) -> list:
        return [(b.type, getattr(b, "text", None), getattr(b, "input", None)) for b in m.content]

    assert [key(m) for m in streamed] == [key(m) for m in whole]


# -------------------------------------------------------------------------- LangChain


def _langchain_agent(server: RunningServer, streaming: bool, calls: list[str]) -> Any:
    """LangChain's agent (create_agent: the model, its tools, the loop between them) on
    chat completions through ChatOpenAI. Its first model call asks for a call, as the SDK
    loops above do; every later one leaves tool_choice unset."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=20)

    @tool(args_schema=City)
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return RESULT

    @wrap_model_call
    def call_first(request: Any, handler: Any) -> Any:
        if not any(isinstance(m, ToolMessage) for m in request.messages):
            request = request.override(tool_choice="required")
        return handler(request)

    model = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model=MODEL,
                       temperature=0, max_tokens=MAX_TOKENS, max_retries=0, timeout=120,
                       streaming=streaming)  # fmt: skip
    return create_agent(model, [get_weather], middleware=[call_first])


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_langchain_agent_runs_the_tool_loop_on_chat(server, streaming):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    calls: list[str] = []
    agent = _langchain_agent(server, streaming, calls)
    state = agent.invoke({"messages": [{"role": "user", "content": ASK}]},
                         {"recursion_limit": 12})  # fmt: skip
    messages = state["messages"]
    assert isinstance(messages[0], HumanMessage) and isinstance(messages[1], AIMessage)
    assert messages[1].tool_calls and calls  # the forced call ran the tool
    for message, after in zip(messages, messages[1:], strict=False):
        if isinstance(message, AIMessage) and message.tool_calls:
            for call in message.tool_calls:
                _valid_arguments(call["name"], call["args"])
            assert isinstance(after, ToolMessage) and after.content == RESULT
    final = messages[-1]
    assert isinstance(final, AIMessage) and not final.tool_calls and final.content
    assert len(calls) == sum(len(m.tool_calls) for m in messages if isinstance(m, AIMessage))
