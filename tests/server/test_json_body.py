"""The one bounded JSON reader: its depth count is exact, needs no recursion, and its
errors are the client's 400s."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.errors import OpenAIError
from server.json_body import (
    MAX_DEPTH,
    JsonTooDeepError,
    check_depth,
    first_unencodable_text,
    loads,
    read_json_body,
)
from server.request_base import integral_floats_as_ints

# Strings full of what the scan must not count: brackets, quotes, backslashes.
TRICKY_TEXT = st.text(st.sampled_from('[]{}"\\:,ab\u00e9\ud83d\ude00'), max_size=6)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | TRICKY_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TRICKY_TEXT, inner, max_size=3),
    max_leaves=30,
)


def depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


@settings(max_examples=300, derandomize=True, deadline=None)
@given(value=JSON_VALUES, ascii_only=st.booleans())
def test_the_depth_count_is_exact(value, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only)
    d = depth(value)
    check_depth(text, max(d, 1))  # at the limit: fine
    if d > 1:
        with pytest.raises(JsonTooDeepError):
            check_depth(text, d - 1)


@pytest.mark.parametrize("kind", ["[", '{"k": '])
def test_the_limit_is_64_levels_the_body_included(kind):
    close = "]" if kind == "[" else "}"
    inner = "1" if kind != "[" else ""
    at_limit = kind * MAX_DEPTH + inner + close * MAX_DEPTH
    assert loads(at_limit) is not None
    over = kind * (MAX_DEPTH + 1) + inner + close * (MAX_DEPTH + 1)
    with pytest.raises(JsonTooDeepError):
        loads(over)


@pytest.mark.parametrize("depth_", [65, 1_000, 100_000, 1_000_000])
def test_any_depth_is_refused_without_recursion(depth_):
    body = '{"user": ' + "[" * depth_ + "]" * depth_ + "}"
    with pytest.raises(OpenAIError) as info:
        read_json_body(body.encode())
    error = info.value
    assert error.status_code == 400 and error.code == "json_too_deep"
    assert error.param == "user.0.0.0.0.0"


def test_unclosed_brackets_are_too_deep_or_malformed_never_a_recursion_error():
    for text in ("[" * 100_000, "[[]" * 100_000, '{"a": ' * 50_000, "]" * 10 + "[" * 70):
        with pytest.raises(ValueError):
            loads(text)


def test_brackets_inside_strings_do_not_count():
    text = json.dumps({"prompt": "[" * 10_000, "stop": ["{" * 500, '\\"[[[[' * 100]})
    assert loads(text)["prompt"] == "[" * 10_000


def test_a_too_deep_key_path_is_readable():
    text = '{"a\\ud800\\nb": ' + "[" * 100 + "]" * 100 + "}"
    with pytest.raises(JsonTooDeepError) as info:
        loads(text)
    assert info.value.path[0] == "a\\ud800\nb"  # the surrogate escaped: it can be logged


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"", "Expecting value"),
        (b" \n\t", "Expecting value"),
        (b'{"prompt": ', "line 1, column 12"),
        (b'{"prompt": "\xff"}', "not valid UTF-8"),
        (b'{"seed": ' + b"7" * 5000 + b"}", "4300"),
    ],
)
def test_malformed_bodies_are_400_invalid_json(raw, words):
    with pytest.raises(OpenAIError) as info:
        read_json_body(raw)
    assert info.value.status_code == 400 and info.value.code == "invalid_json"
    assert words in info.value.message


def test_bodies_are_read_as_json_reads_bytes():
    assert read_json_body(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}  # a UTF-8 byte order mark
    assert read_json_body('{"a": "\u00e9"}'.encode("utf-16")) == {"a": "\u00e9"}
    with pytest.raises(OpenAIError) as info:  # UTF-8 of a surrogate: the field is named
        read_json_body(b'{"messages": [{"content": "\xed\xa0\x80"}]}')
    assert info.value.param == "messages.0.content"


def test_the_walks_after_parsing_need_no_recursion():
    deep: Any = "\ud800"
    for _ in range(100_000):
        deep = [deep]
    assert first_unencodable_text({"x": deep}) == ("x", *["0"] * 100_000)
    floats: Any = 2.0
    for _ in range(100_000):
        floats = {"k": [floats, 2.5]}
    converted = integral_floats_as_ints(floats)
    for _ in range(100_000):
        assert converted["k"][1] == 2.5
        converted = converted["k"][0]
    assert converted == 2 and isinstance(converted, int)
