"""Structured outputs and tool calls through the HTTP API, with the real OpenAI SDK.

The default model (SmolLM2-135M-Instruct) serves the constrained requests; a tiny random
model with a Hermes-style tool template serves tool_choice "auto", its output forced
into a `<tool_call>` block by a one-string choice so the parser has something to find.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.engine.tiny_models import make_tiny_model_dir
from tests.server.conftest import RunningServer, assert_openai_error, make_engine, running_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 20}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "number", "minimum": 0, "maximum": 40},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 20},
                      "minItems": 1, "maxItems": 3},
    },
    "required": ["city", "population_millions", "landmarks"],
    "additionalProperties": False,
}  # fmt: skip


@pytest.fixture(scope="module")
def default_server() -> Iterator[RunningServer]:
    engine = make_engine(None, num_blocks=256, max_model_len=2048)
    with running_server(engine, served_model_name=None) as server:
        yield server


def chat(server: RunningServer, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", 150)
    kwargs.setdefault("temperature", 0)
    return server.openai().chat.completions.create(model="SmolLM2-135M-Instruct", **kwargs)


# ------------------------------------------------------------------- structured outputs


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_response_format_json_schema_validates(default_server, temperature):
    r = chat(default_server, n=2, temperature=temperature, seed=5, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})  # fmt: skip
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


def test_sdk_parse_with_a_pydantic_model(default_server):
    client = default_server.openai()
    r = client.chat.completions.parse(
        model="SmolLM2-135M-Instruct", messages=ASK, response_format=City, max_tokens=100,
        temperature=0,
    )  # fmt: skip
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name


def test_json_object_parses(default_server):
    r = chat(default_server, response_format={"type": "json_object"},
             messages=[{"role": "user", "content": 'Reply with {"answer": 42} as JSON.'}])  # fmt: skip
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_completions_take_vllm_extras_and_response_format(default_server):
    client = default_server.openai()
    cases = [
        ({"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}, r"[0-9]{3}-[0-9]{4}"),
        ({"guided_regex": "(cat|dog)s? are (great|fine)"}, r"(cat|dog)s? are (great|fine)"),
        ({"guided_choice": ["red", "green"]}, "red|green"),
        ({"structured_outputs": {"grammar": 'root ::= "x=" [0-9] [0-9]'}}, "x=[0-9]{2}"),
    ]
    import re

    for extra, pattern in cases:
        r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="My answer:",
                                      max_tokens=30, temperature=0, extra_body=extra)  # fmt: skip
        assert re.fullmatch(pattern, r.choices[0].text), (extra, r.choices[0].text)
    r = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="A city as JSON:", max_tokens=150, temperature=0,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "c", "schema": SCHEMA}}},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_streamed_choice_is_one_of_the_choices(default_server):
    stream = chat(default_server, stream=True, extra_body={"guided_choice": ["sunny", "rainy"]})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text in ("sunny", "rainy")


def test_grammar_metrics_count_compiles_and_hits(default_server):
    before_hits = default_server.metric("pagedserve:grammar_requests_total", cache="hit")
    before_compiles = default_server.metric("pagedserve:grammar_compile_seconds_count")
    regex = "metrics-[a-z]{4}"
    for _ in range(2):
        chat(default_server, max_tokens=20, extra_body={"guided_regex": regex})
    assert default_server.metric("pagedserve:grammar_compile_seconds_count") == before_compiles + 1
    assert (
        default_server.metric("pagedserve:grammar_requests_total", cache="hit") == before_hits + 1
    )


# ------------------------------------------------------------------------- tool calls


def _assert_valid_call(call: Any) -> None:
    tool = {t["function"]["name"]: t for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.type == "function" and call.id.startswith("call_")


def test_tool_choice_required_gives_valid_calls(default_server):
    r = chat(default_server, tools=TOOLS, tool_choice="required")
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None
    assert message.tool_calls
    for call in message.tool_calls:
        _assert_valid_call(call)


def test_named_tool_choice_calls_that_function(default_server):
    r = chat(default_server, tools=TOOLS,
             tool_choice={"type": "function", "function": {"name": "get_time"}})  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _assert_valid_call(call)


def reassemble(stream: Any) -> tuple[list[dict[str, str]], str | None, str]:
    """Tool-call deltas joined per index (the SDK's documented way), the finish reason and
    any content."""
    calls: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += d.id or ""
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_streamed_tool_call_deltas_reassemble_to_the_same_calls(default_server, tool_choice):
    whole = chat(default_server, tools=TOOLS, tool_choice=tool_choice).choices[0].message
    streamed, finish, content = reassemble(
        chat(default_server, tools=TOOLS, tool_choice=tool_choice, stream=True)
    )
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in streamed)


BOOK_TABLE = {
    "type": "function",
    "function": {
        "name": "book_table",
        "parameters": {
            "type": "object",
            "properties": {
                "people": {"type": "integer", "minimum": 1, "maximum": 12},
                "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
            },
            "required": ["people", "time"],
        },
    },
}


def test_required_calls_cut_by_max_tokens_are_the_same_streamed_or_not(default_server):
    """The default model repeats book_table calls until max_tokens cuts the array: both forms
    return the calls that closed, with finish_reason "length" saying the array was cut."""
    kwargs: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Table for 4 at 19:30 please"}],
        "tools": [BOOK_TABLE], "tool_choice": "required", "max_tokens": 100,
    }  # fmt: skip
    whole = chat(default_server, **kwargs).choices[0]
    streamed, finish, content = reassemble(chat(default_server, stream=True, **kwargs))
    assert whole.finish_reason == finish == "length"
    assert whole.message.content is None and content == ""
    assert len(whole.message.tool_calls) >= 2, whole.message
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls
    ]


def test_tool_choice_none_ignores_tools(default_server):
    plain = chat(default_server, max_tokens=12)
    with_tools = chat(default_server, max_tokens=12, tools=TOOLS, tool_choice="none")
    assert with_tools.choices[0].message.content == plain.choices[0].message.content
    assert with_tools.usage.prompt_tokens == plain.usage.prompt_tokens
    assert not with_tools.choices[0].message.tool_calls


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": 5}}}},
         "response_format.json_schema.schema", "not a valid JSON Schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "not": {"const": "a"}}}}},
         "response_format.json_schema.schema", "`not` is not supported"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "parenthesis"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar",
         "missing"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
         "exactly one"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
         "Only one output constraint"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "'nope'"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tools",
         "Only one output constraint"),
        # tool_choice "auto" (the default) on a template without tools: the generic
        # format's grammar checks each tool's schema as a lone schema is checked.
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"not": {"const": 1}}}}}}]},
         "tools", "`not` is not supported"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": 5}}}], "tool_choice": "auto"},
         "tools", "not a valid JSON Schema"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400_naming_the_field(default_server, body, param, words):
    response = default_server.http().post(
        "/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, **body}
    )
    error = assert_openai_error(response, 400, param)
    assert words in error["message"], error
    assert default_server.all_blocks_free()


# ------------------------------------------------------------ recursive and deep schemas

# A linked list: recursion with a way out (`next` may be null), inline and through $defs.
LINKED_LIST = {
    "type": "object",
    "properties": {
        "v": {"type": "integer", "minimum": 0, "maximum": 9},
        "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
    },
    "required": ["v", "next"],
    "additionalProperties": False,
}
LINKED_LIST_DEFS = {"$defs": {"node": {**LINKED_LIST, "properties": {
    "v": LINKED_LIST["properties"]["v"],
    "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}},
    "$ref": "#/$defs/node"}  # fmt: skip
# $refs that only point at each other: no JSON value matches (they answered 200, empty).
REF_LOOPS = [
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
]


def constrained_by(place: str, schema: Any) -> dict[str, Any]:
    if place == "response_format":
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "s", "schema": schema}}}  # fmt: skip
    if place == "guided_json (text)":
        return {"guided_json": json.dumps(schema)}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    return {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}}


PLACES = {"response_format": "response_format.json_schema.schema",
          "guided_json (text)": "guided_json", "tools": "tools"}  # fmt: skip


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("schema", REF_LOOPS, ids=["a-a", "a-b-a"])
def test_refs_that_only_point_at_each_other_are_400(default_server, schema, place):
    body = {"messages": ASK, "max_tokens": 5, **constrained_by(place, schema)}
    response = default_server.http().post("/v1/chat/completions", json=body)
    error = assert_openai_error(response, 400, PLACES[place])
    assert "describes no JSON value" in error["message"], error
    assert default_server.all_blocks_free()


@pytest.mark.parametrize("schema", [LINKED_LIST, LINKED_LIST_DEFS], ids=["inline", "defs"])
def test_a_recursive_schema_with_a_way_out_is_served(default_server, schema):
    # Asked for a short list: greedy, the 135M model otherwise nests "next" until max_tokens.
    ask = [{"role": "user", "content": 'Reply with this JSON: {"v": 1, "next": {"v": 2, '
                                       '"next": null}}'}]  # fmt: skip
    r = chat(default_server, messages=ask, max_tokens=100, response_format={
        "type": "json_schema", "json_schema": {"name": "list", "schema": schema}})  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content)
    jsonschema.validate(value, schema)
    assert value["next"] is not None  # the recursion itself was taken


def deep_schema(levels: int) -> str:
    """A schema of objects `levels` deep, as JSON text (json.dumps would recurse)."""
    return (
        '{"type": "object", "properties": {"a": ' * levels + '{"type": "integer"}' + "}}" * levels
    )


@pytest.mark.parametrize("levels", [100, 240, 480])
@pytest.mark.parametrize("place", PLACES)
def test_a_deep_schema_is_400_in_our_words(default_server, levels, place):
    # 100 levels was Python's "maximum recursion depth exceeded", 240-480 a 500.
    text = deep_schema(levels)
    as_text = place == "guided_json (text)"
    extra = {"guided_json": "@S@"} if as_text else constrained_by(place, "@S@")
    body = json.dumps({"messages": ASK, "max_tokens": 5, **extra})
    body = body.replace('"@S@"', json.dumps(text) if as_text else text)
    response = default_server.http().post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    error = assert_openai_error(response, 400)
    assert "more than 64 levels deep" in error["message"], error
    assert error["param"].startswith(PLACES[place].split(".")[0]), error
    assert "recursion" not in error["message"]


# -------------------------------------------------------------- tool_choice "auto" (Hermes)

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call> to call one.<|im_end|>
{% endif %}{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}{%- for call in message.tool_calls or [] %}
<tool_call>
{{ call.function | tojson }}
</tool_call>{%- endfor %}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
CALL_TEXT = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", ' \
            '"unit": "celsius"}}\n</tool_call>'  # fmt: skip


@pytest.fixture(scope="module")
def hermes_server(tmp_path_factory) -> Iterator[RunningServer]:
    path = make_tiny_model_dir(tmp_path_factory.mktemp("hermes-model"))
    Path(path, "chat_template.jinja").write_text(HERMES_TEMPLATE)
    with running_server(make_engine(path)) as server:
        yield server


def test_auto_tool_calls_are_parsed_from_hermes_blocks(hermes_server):
    client = hermes_server.openai()
    kwargs = {"model": "tiny-test-model", "messages": ASK, "tools": TOOLS, "max_tokens": 80,
              "extra_body": {"guided_choice": [CALL_TEXT]}}  # fmt: skip
    r = client.chat.completions.create(**kwargs)
    message = r.choices[0].message
    assert message.content == "Let me check."
    (call,) = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris", "unit": "celsius"})  # fmt: skip
    assert r.choices[0].finish_reason == "tool_calls"
    calls, finish, content = reassemble(client.chat.completions.create(stream=True, **kwargs))
    assert content == "Let me check." and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)]  # fmt: skip


def test_auto_shows_the_template_the_tools_and_the_earlier_calls(hermes_server):
    client = hermes_server.openai()
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]  # fmt: skip
    r = client.chat.completions.create(model="tiny-test-model", messages=history, tools=TOOLS,
                                       max_tokens=3)  # fmt: skip
    tokenizer = hermes_server.engine.core.tokenizer
    conversation = [
        ASK[0],
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "content": "18 degrees", "tool_call_id": "call_1"},
    ]  # fmt: skip
    expected = tokenizer.apply_chat_template(conversation, tools=TOOLS,
                                             add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert '"name": "get_weather"' in expected and "18 degrees" in expected
    assert r.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False))


def test_none_still_shows_a_tool_template_its_tools_but_reads_no_calls(hermes_server):
    client = hermes_server.openai()
    r = client.chat.completions.create(model="tiny-test-model", messages=ASK, tools=TOOLS,
                                       tool_choice="none", max_tokens=80,
                                       extra_body={"guided_choice": [CALL_TEXT]})  # fmt: skip
    tokenizer = hermes_server.engine.core.tokenizer
    expected = tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
    assert r.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False))
    assert r.choices[0].message.content == CALL_TEXT and not r.choices[0].message.tool_calls
