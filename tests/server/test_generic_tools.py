"""The generic tool format (server/generic_tools.py) without a server: how a conversation
with tools, calls and results is written for a template without tools, and what the
"auto" grammar lets through, checked with xgrammar's matcher over the default tokenizer."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr

from engine.structured_output.grammar_cache import GrammarCache, GrammarError, embedded_schemas
from scheduler.structured_outputs import StructuredOutputs
from server.generic_tools import (
    auto_constraint,
    call_block,
    declares_tools,
    generic_conversation,
    tools_text,
)
from server.tool_parsers import parse_hermes
from tests.engine.tiny_models import VOCAB_SIZE, default_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"], "additionalProperties": False}}}  # fmt: skip
NO_ARGS = {"type": "function", "function": {"name": "now"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_declares_tools_reads_the_template_text():
    assert declares_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not declares_tools("{{ messages }}")
    assert not declares_tools(None)


def test_tools_go_into_the_system_turn_the_conversations_own_or_a_new_one():
    tools = [WEATHER]
    ask = {"role": "user", "content": "Weather?"}
    [system, user] = generic_conversation([ask], tools)
    assert system["role"] == "system" and system["content"] == tools_text(tools)
    assert json.dumps(WEATHER) in system["content"] and "<tool_call>" in system["content"]
    assert user == ask
    [system, _] = generic_conversation([{"role": "system", "content": "Be brief."}, ask], tools)
    assert system["content"] == "Be brief.\n\n" + tools_text(tools)
    assert generic_conversation([ask], None) == [ask]  # tool_choice "none": not shown


def test_calls_and_results_are_written_as_text_results_sharing_a_user_turn():
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
             {"id": "c2", "type": "function", "function": {"name": "now", "arguments": {}}}]  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "user", "content": "Coat?"},
    ]
    out = generic_conversation(messages, None)
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert out[1] == {"role": "assistant", "content": "Checking.\n" + CALL + "\n"
                      + call_block("now", {})}  # fmt: skip
    assert out[2]["content"] == (
        "<tool_response>\n18C\n</tool_response>\n<tool_response>\nnoon\n</tool_response>\nCoat?"
    )
    # The model reads back its own calls in the very format it is asked to write.
    assert parse_hermes(out[1]["content"])[1][0].arguments == '{"city": "Paris"}'


@pytest.fixture(scope="module")
def grammars() -> GrammarCache:
    return GrammarCache(default_tokenizer(), VOCAB_SIZE, [2])


def _accepts(grammars: GrammarCache, spec: StructuredOutputs, text: str) -> bool:
    """Whether the whole of `text` is a complete output under `spec`."""
    matcher = xgr.GrammarMatcher(grammars.compile(spec).grammar)
    if not matcher.accept_string(text):
        return False
    return matcher.is_terminated() or matcher.accept_token(2)  # 2: the end of text


def _accepts_prefix(grammars: GrammarCache, spec: StructuredOutputs, text: str) -> bool:
    return xgr.GrammarMatcher(grammars.compile(spec).grammar).accept_string(text)


def test_auto_lets_the_model_reply_or_call_but_keeps_calls_well_formed(grammars):
    spec = auto_constraint([WEATHER, NO_ARGS], single=False)
    assert _accepts(grammars, spec, "It is sunny in Paris, as far as I know.")
    assert _accepts(grammars, spec, CALL)
    assert _accepts(grammars, spec, "Let me look.\n" + CALL + "\n" + call_block("now", {}))
    assert not _accepts_prefix(grammars, spec, "Here: <tool_response>")  # a made-up result
    for broken in ('<tool_call>\n{"name": "nope"',  # no such tool
                   '<tool_call>\n{"name": "get_weather", "arguments": {"town": ',  # not its schema
                   '<tool_call> {"name"'):  # not the wrapper  # fmt: skip
        assert not _accepts_prefix(grammars, spec, broken), broken


def test_a_single_call_ends_the_output_without_parallel_calls(grammars):
    spec = auto_constraint([WEATHER], single=True)
    matcher = xgr.GrammarMatcher(grammars.compile(spec).grammar)
    assert matcher.accept_string(CALL)
    assert not matcher.accept_string("\n<tool_call>")


def test_with_an_answer_format_the_output_is_calls_or_that_answer(grammars):
    answer = StructuredOutputs.json_schema({"type": "object", "properties": {
        "coat": {"type": "boolean"}}, "required": ["coat"], "additionalProperties": False})  # fmt: skip
    spec = auto_constraint([WEATHER], single=False, answer=answer)
    assert _accepts(grammars, spec, '{"coat": true}')
    assert _accepts(grammars, spec, CALL + "\n" + CALL)
    assert not _accepts_prefix(grammars, spec, "Sure, ")
    for kind, value, text in [("regex", "[0-9]+", "42"), ("grammar", 'root ::= "ok"', "ok")]:
        spec = auto_constraint([WEATHER], False, StructuredOutputs(kind, value))  # type: ignore[arg-type]
        assert _accepts(grammars, spec, text) and _accepts(grammars, spec, CALL)
    spec = auto_constraint([WEATHER], False, StructuredOutputs.choices(["yes", "no"]))
    assert _accepts(grammars, spec, "no")


@pytest.mark.parametrize(
    ("parameters", "words"),
    [
        ({"type": "object", "properties": {"a": {"not": {"const": 1}}}}, "`not`"),
        ({"type": "object", "properties": 5}, "not a valid JSON Schema"),
        ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "$ref"),
        ("a string", "must be an object"),
    ],
)
def test_a_tool_schema_the_compiler_cannot_bear_is_refused_before_it(grammars, parameters, words):
    tool: dict[str, Any] = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(GrammarError) as refused:
        grammars.compile(auto_constraint([tool], single=False))
    assert words in str(refused.value)


def test_embedded_schemas_finds_every_schema_and_looks_no_deeper():
    tag = json.loads(auto_constraint([WEATHER, NO_ARGS], False).spec)
    found = embedded_schemas(tag)
    assert found == [WEATHER["function"]["parameters"], {"type": "object", "properties": {}}]
