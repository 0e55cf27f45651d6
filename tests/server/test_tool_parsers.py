"""Tool call parsing: Hermes `<tool_call>` blocks and JSON arrays of calls, whole and streamed."""

from __future__ import annotations

import json
import re

import pytest

from server.tool_parsers import (
    CallArrayStream,
    HermesStream,
    ToolCall,
    parse_hermes,
)

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>{"name": "get_time", "parameters": {"tz": "UTC"}}</tool_call>'
BAD_JSON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'

# Texts for the whole-vs-streamed comparison: every Hermes case the whole parser handles.
HERMES_TEXTS = [
    "Just text, no tools.",
    WEATHER,
    "Let me check.\n" + WEATHER + "\nand\n" + TIME + "\nDone.",
    '<tool_call> {"name": "f", "arguments": "{\\"x\\": 1}"} </tool_call>',
    "before " + BAD_JSON + " after",
    '<tool_call>{"arguments": {"x": 1}}</tool_call>',
    "text " + WEATHER + ' then <tool_call>\n{"name": "cut',
    "a < b and <tools> and <tool_call and </tool_call> " + TIME,
    '<tool_call>{"name": "météo", "arguments": {"ville": "Zürich 東京"}}</tool_call>',
    "<<tool_call>" + '{"name": "f", "arguments": {}}' + "</tool_call>>",
]


def pairs(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def stream_hermes(deltas: list[str]) -> tuple[str, list[ToolCall]]:
    parser = HermesStream()
    content: list[str] = []
    calls: list[ToolCall] = []
    for delta in [*deltas, None]:
        text, done = parser.feed(delta) if delta is not None else parser.finish()
        content.append(text)
        calls.extend(done)
    return "".join(content), calls


def splits(text: str) -> list[list[str]]:
    """The text in two pieces at every position, and in 1-char deltas."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


# --- parse_hermes -----------------------------------------------------------------------


def test_plain_text_has_no_calls() -> None:
    assert parse_hermes("  Hello there.\n") == ("Hello there.", [])
    assert parse_hermes("") == (None, [])


def test_one_call_and_no_content() -> None:
    content, calls = parse_hermes(WEATHER)
    assert content is None
    assert pairs(calls) == [("get_weather", {"city": "Paris"})]
    assert calls[0].arguments == '{"city": "Paris"}'


def test_two_calls_with_text_before_and_between() -> None:
    content, calls = parse_hermes("Let me check.\n" + WEATHER + "\nand\n" + TIME + "\n")
    assert content == "Let me check.\n\nand"
    assert pairs(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]


def test_arguments_as_a_json_string() -> None:
    _, calls = parse_hermes(HERMES_TEXTS[3])
    assert pairs(calls) == [("f", {"x": 1})]


def test_parameters_is_a_synonym_of_arguments() -> None:
    assert pairs(parse_hermes(TIME)[1]) == [("get_time", {"tz": "UTC"})]


def test_missing_arguments_are_an_empty_object() -> None:
    assert pairs(parse_hermes('<tool_call>{"name": "ping"}</tool_call>')[1]) == [("ping", {})]


@pytest.mark.parametrize(
    "block",
    [
        BAD_JSON,
        '<tool_call>{"arguments": {"x": 1}}</tool_call>',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
        "<tool_call>[1, 2]</tool_call>",
    ],
)
def test_bad_block_is_left_in_content_as_written(block: str) -> None:
    assert parse_hermes("before " + block + " after") == ("before " + block + " after", [])


def test_unterminated_block_stays_content() -> None:
    content, calls = parse_hermes('Sure. <tool_call>\n{"name": "cut')
    assert (content, calls) == ('Sure. <tool_call>\n{"name": "cut', [])


def test_non_ascii_arguments_are_kept_as_is() -> None:
    _, calls = parse_hermes(HERMES_TEXTS[8])
    assert calls[0].name == "météo"
    assert calls[0].arguments == '{"ville": "Zürich 東京"}'


def test_call_ids_are_unique_and_openai_shaped() -> None:
    _, calls = parse_hermes(WEATHER + WEATHER)
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    assert calls[0].id != calls[1].id


# --- HermesStream -----------------------------------------------------------------------


@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_stream_matches_whole_parse_at_every_split(text: str) -> None:
    want_content, want_calls = parse_hermes(text)
    for deltas in splits(text):
        content, calls = stream_hermes(deltas)
        assert (content.strip() or None) == want_content, deltas
        assert pairs(calls) == pairs(want_calls), deltas


def test_stream_sends_text_before_a_partial_tag_and_holds_only_the_tag() -> None:
    parser = HermesStream()
    assert parser.feed("abc<tool") == ("abc", [])
    assert parser.feed("s>") == ("<tools>", [])
    assert parser.feed("a <") == ("a ", [])
    assert parser.feed(" b") == ("< b", [])
    assert parser.finish() == ("", [])


def test_stream_emits_a_call_when_its_block_closes() -> None:
    parser = HermesStream()
    assert parser.feed("Hi <tool_call>") == ("Hi ", [])
    assert parser.feed('{"name": "f", "arguments": {"a": 1}}</tool_') == ("", [])
    content, calls = parser.feed("call> bye")
    assert (content, pairs(calls)) == (" bye", [("f", {"a": 1})])


def test_stream_bad_block_comes_out_as_content() -> None:
    parser = HermesStream()
    assert parser.feed(BAD_JSON) == (BAD_JSON, [])


def test_stream_finish_returns_the_unterminated_block() -> None:
    parser = HermesStream()
    assert parser.feed('ok <tool_call>{"name": "f"') == ("ok ", [])
    assert parser.finish() == ('<tool_call>{"name": "f"', [])


def test_stream_finish_returns_a_held_partial_tag() -> None:
    parser = HermesStream()
    assert parser.feed("x <tool_ca") == ("x ", [])
    assert parser.finish() == ("<tool_ca", [])


# --- CallArrayStream -------------------------------------------------------------------

ARRAYS = [
    '[{"name": "f", "parameters": {"a": 1}}]',
    '[{"name":"f","parameters":{"a":[1,{"b":"]"}]}},{"name":"g","arguments":{"s":"x,}"}}]',
    ' \n[ \n {"name": "f", "parameters": {}} ,\n\t{"name": "g", "parameters": {"q": "é"}} \n] \n',
    "[]",
]


def whole_array(text: str) -> list:
    return CallArrayStream().feed(text)


def test_array_one_call() -> None:
    assert pairs(whole_array(ARRAYS[0])) == [("f", {"a": 1})]


def test_array_two_calls_with_arguments_synonym() -> None:
    assert pairs(whole_array(ARRAYS[1])) == [
        ("f", {"a": [1, {"b": "]"}]}),
        ("g", {"s": "x,}"}),
    ]


def test_array_whitespace_and_non_ascii() -> None:
    calls = whole_array(ARRAYS[2])
    assert pairs(calls) == [("f", {}), ("g", {"q": "é"})]
    assert calls[1].arguments == '{"q": "é"}'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"name": "f", "parameters": {}}', "array"),
        ('[{"parameters": {}}]', "name"),
        ('[{"name": "f", "parameters": 3}]', "object"),
        ('["f"]', "object"),
    ],
)
def test_array_rejects_what_is_not_a_call_array(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        whole_array(text)


@pytest.mark.parametrize("text", ARRAYS)
def test_array_stream_gives_the_same_calls_at_every_split(text: str) -> None:
    want = pairs(whole_array(text))
    for deltas in splits(text):
        stream = CallArrayStream()
        assert pairs([call for d in deltas for call in stream.feed(d)]) == want, deltas


def test_an_array_cut_short_gives_the_calls_that_closed() -> None:
    cut = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parame'
    assert pairs(whole_array(cut)) == [("f", {"a": 1})]


def test_array_stream_yields_each_call_when_its_object_closes() -> None:
    stream = CallArrayStream()
    assert stream.feed('[{"name": "f", "parameters": {"a": 1}') == []
    assert pairs(stream.feed('}, {"name": "g", ')) == [("f", {"a": 1})]
    assert pairs(stream.feed('"parameters": {}}]')) == [("g", {})]


@pytest.mark.parametrize(
    "text", ['{"name": "f"}', '[{"name": "f"} {"name": "g"}]', '[{"parameters": {}}]']
)
def test_array_stream_rejects_structural_faults(text: str) -> None:
    with pytest.raises(ValueError):
        CallArrayStream().feed(text)
