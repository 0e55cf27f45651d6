"""Any text in any string field: a lone surrogate ("\\ud800" is valid JSON) is a 400 that
names the field, everything else is served or refused in the OpenAI shape, never a 500."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.server.conftest import RunningServer, assert_openai_error

COMPLETION = {"prompt": "hi", "max_tokens": 1}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def at(base: dict[str, Any], path: str) -> Callable[[str], dict[str, Any]]:
    """A body builder that puts the text at a dotted path of `base` (list indexes as digits)."""

    def build(text: str) -> dict[str, Any]:
        body = copy.deepcopy(base)
        *parents, last = path.split(".")
        node: Any = body
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        if isinstance(node, list):
            node[int(last)] = text
        else:
            node[last] = text
        return body

    return build


def key_of(base: dict[str, Any], field: str, value: Any) -> Callable[[str], dict[str, Any]]:
    """A body builder that uses the text as an object key of `field` (at the top: a field name)."""

    def build(text: str) -> dict[str, Any]:
        body = copy.deepcopy(base)
        if field:
            body[field] = {text: value}
        else:
            body[text] = value
        return body

    return build


# (route, body builder, the param a lone surrogate's 400 names): every string of the protocol.
STRING_FIELDS = [
    ("/v1/completions", at(COMPLETION, "prompt"), "prompt"),
    ("/v1/completions", at({**COMPLETION, "prompt": ["ok", ""]}, "prompt.1"), "prompt.1"),
    ("/v1/completions", at(COMPLETION, "model"), "model"),
    ("/v1/completions", at(COMPLETION, "stop"), "stop"),
    ("/v1/completions", at({**COMPLETION, "stop": ["a", ""]}, "stop.1"), "stop.1"),
    ("/v1/completions", at(COMPLETION, "user"), "user"),
    ("/v1/completions", at(COMPLETION, "cache_salt"), "cache_salt"),
    ("/v1/completions", key_of(COMPLETION, "logit_bias", 1.0), "logit_bias"),
    ("/v1/completions", at(COMPLETION, "suffix"), "suffix"),
    ("/v1/completions", at(COMPLETION, "some_future_field"), "some_future_field"),
    ("/v1/completions", key_of(COMPLETION, "", 1), None),
    ("/v1/chat/completions", at(CHAT, "messages.0.content"), "messages.0.content"),
    ("/v1/chat/completions", at(CHAT, "messages.0.role"), "messages.0.role"),
    ("/v1/chat/completions", at(CHAT, "messages.0.name"), "messages.0.name"),
    (
        "/v1/chat/completions",
        at(
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
            "messages.0.content.0.text",
        ),
        "messages.0.content.0.text",
    ),  # fmt: skip
    ("/v1/chat/completions", at(CHAT, "model"), "model"),
    ("/v1/chat/completions", at(CHAT, "stop"), "stop"),
    ("/v1/chat/completions", at(CHAT, "user"), "user"),
    ("/v1/chat/completions", at(CHAT, "tool_choice"), "tool_choice"),
    ("/v1/chat/completions", at(CHAT, "response_format.type"), "response_format.type"),
    ("/v1/chat/completions", at({**CHAT, "modalities": [""]}, "modalities.0"), "modalities.0"),
    ("/tokenize", at({}, "prompt"), "prompt"),
    ("/tokenize", at({"prompt": "hi"}, "model"), "model"),
    ("/tokenize", at({"messages": [{"role": "user"}]}, "messages.0.content"), "messages.0.content"),
    ("/detokenize", at({"tokens": [1]}, "model"), "model"),
]
LONE_SURROGATES = ["\ud800", "a\udfffb", "\udc00\ud800"]  # the last: low before high


def as_the_server_reads_it(text: str) -> str:
    # JSON escapes each UTF-16 unit; the parser re-pairs a high surrogate followed by a low.
    return json.loads(json.dumps(text))


def post(server: RunningServer, route: str, body: dict[str, Any]) -> Any:
    # ensure_ascii: a lone surrogate travels as a \ud800 escape, as any JSON encoder sends it.
    payload = json.dumps(body, ensure_ascii=True).encode()
    return server.http().post(route, content=payload, headers={"content-type": "application/json"})


@pytest.mark.parametrize(("route", "build", "param"), STRING_FIELDS)
@pytest.mark.parametrize("text", LONE_SURROGATES)
def test_lone_surrogate_is_400_naming_the_field(server, route, build, param, text):
    error = assert_openai_error(post(server, route, build(text)), 400, param)
    assert error["type"] == "invalid_request_error" and "surrogate" in error["message"]


@pytest.mark.parametrize(("route", "build", "param"), STRING_FIELDS)
@settings(max_examples=4, deadline=None, derandomize=True)
@given(text=st.text(st.characters(), max_size=8))  # characters() includes surrogates
@example(text="\ud83d\ude00")  # a valid pair as two escapes: one emoji to the server
def test_any_text_in_any_string_field_is_never_a_500(server, route, build, param, text):
    response = post(server, route, build(text))
    try:
        as_the_server_reads_it(text).encode("utf-8")
    except UnicodeEncodeError:
        assert_openai_error(response, 400, param)
        return
    assert response.status_code in (200, 400, 404), response.text
    if response.status_code != 200:
        assert_openai_error(response, response.status_code)


def test_keep_alive_connection_survives_a_lone_surrogate(server):
    # After the 500 a lone surrogate used to cause, uvicorn sometimes dropped the connection.
    with server.http() as http:
        for _ in range(3):
            bad = http.post(
                "/v1/completions",
                content=b'{"prompt": "\\ud800 hi", "max_tokens": 2}',
                headers={"content-type": "application/json"},
            )
            assert_openai_error(bad, 400, "prompt")
            assert bad.headers.get("connection") != "close"
            good = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert good.status_code == 200, good.text
