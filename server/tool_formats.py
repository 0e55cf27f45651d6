"""Which tool-call format a model writes under tool_choice "auto", chosen by its chat template
(or by --tool-call-parser), and the readers for the formats that are not Hermes'.

* "hermes": `<tool_call>{"name", "arguments"}</tool_call>` blocks amid text (Qwen2.5,
  Hermes, and the generic format of server/generic_tools.py); server/tool_parsers.py.
* "llama3_json": the whole answer is one or more `{"name", "parameters"}` objects (split by
  `;` or whitespace), after an optional `<|python_tag|>` (Llama 3.1 to 3.3).
* "mistral": `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` objects (Mistral's
  v3 tokenizer templates), or, from v11 (Mistral Small 3.1 and later), each call as
  `[TOOL_CALLS]name[ARGS]{arguments}`, one after another. Both tags are special tokens that
  the detokenizer drops by default, so the array alone, and `name{arguments}...` alone,
  are read the same way.
* "harmony": gpt-oss' messages, a call being a message to `functions.NAME`; its reader
  (server/harmony.py) splits out the reasoning and the answer as well, in place of the
  reasoning parser.

In "llama3_json" and "mistral" a call is the whole output, so the reader decides from how the output
begins: text that starts like a call is held back to the end and parsed whole; text that
cannot be one streams as content at once. A call that does not parse stays content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from server.tool_parsers import HermesStream, ToolCall, call_from_object, parse_hermes

TOOL_PARSERS = ("auto", "harmony", "hermes", "llama3_json", "mistral")
PYTHON_TAG, MISTRAL_TAG, ARGS_TAG = "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")  # a function's name, as OpenAI's tools allow
# What a template says when its model writes each format (harmony: gpt-oss' channels,
# server/harmony.py, which reads its reasoning and answer too).
_MARKERS = {"harmony": ("<|channel|>",),
            "mistral": ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]"),
            "llama3_json": (PYTHON_TAG, "Environment: ipython")}  # fmt: skip


def resolve_tool_parser(name: str, chat_template: Any) -> str:
    """The format "auto" stands for with this template (Hermes' unless it names another)."""
    if name != "auto":
        return name
    text = str(chat_template or "")
    for parser, markers in _MARKERS.items():
        if any(marker in text for marker in markers):
            return parser
    return "hermes"


def _json_values(text: str, separators: str) -> list[Any] | None:
    """The JSON values `text` is made of, apart from `separators` between them; None when
    anything else is there."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos] in separators:
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):
            return None
        values.append(value)


def _calls(objects: list[Any] | None) -> list[ToolCall] | None:
    try:
        return [call_from_object(obj) for obj in objects] if objects else None
    except ValueError:
        return None


def parse_llama3_json(text: str) -> list[ToolCall] | None:
    """The calls the whole output makes, or None when it is not calls."""
    body = text.strip().removeprefix(PYTHON_TAG)
    return _calls(_json_values(body, " \t\n\r;"))


def parse_mistral(text: str) -> list[ToolCall] | None:
    """The calls the whole output makes, in the v3 form or the v11 one; None when it is
    not calls."""
    body = text.strip()
    values = _json_values(body.removeprefix(MISTRAL_TAG).strip(), " \t\n\r")
    if values and all(isinstance(v, list) for v in values):
        return _calls([obj for array in values for obj in array])
    return _calls(_v11_calls(body))


def _v11_calls(text: str) -> list[dict[str, Any]] | None:
    """v11's `[TOOL_CALLS]name[ARGS]{...}` calls, one after another, either tag perhaps
    dropped with the special tokens; None when anything else is there."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return calls or None
        pos += len(MISTRAL_TAG) if text.startswith(MISTRAL_TAG, pos) else 0
        name = _NAME.match(text, pos)
        if name is None:
            return None
        pos = name.end() + (len(ARGS_TAG) if text.startswith(ARGS_TAG, name.end()) else 0)
        try:
            arguments, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):
            return None
        calls.append({"name": name.group(), "arguments": arguments})


def _by_prefix(starts: tuple[str, ...]) -> Callable[[str], str | None]:
    """How an output's beginning reads: "calls" when it starts with one of `starts`,
    "content" when it cannot, None while it still may."""

    def classify(head: str) -> str | None:
        if any(head.startswith(s) for s in starts):
            return "calls"
        return None if any(s.startswith(head) for s in starts) else "content"

    return classify


_MISTRAL_V3_HEAD = _by_prefix((MISTRAL_TAG, "[{"))


def _mistral_head(head: str) -> str | None:
    """`_by_prefix` for v3's `[TOOL_CALLS]` and `[{`, and v11's `name{` or `name[ARGS]`
    (a name is held until what follows it shows whether it is one)."""
    found = _MISTRAL_V3_HEAD(head)
    name = _NAME.match(head) if found == "content" else None
    if name is None:
        return found
    rest = head[name.end() :]
    if not rest or ARGS_TAG.startswith(rest):
        return None
    return "calls" if rest.startswith(("{", ARGS_TAG)) else "content"


class WholeOutputCalls:
    """A reader for formats where calls are the whole output: feed -> (content, calls)."""

    def __init__(
        self, classify: Callable[[str], str | None], parse: Callable[[str], list[ToolCall] | None]
    ):
        self._classify = classify  # an output's beginning -> "calls", "content" or None
        self._parse = parse
        self._buf = ""
        self._state = "start"  # -> "calls" (held to the end) or "content" (streamed)

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._buf += delta
        if self._state == "start":
            self._state = self._classify(self._buf.lstrip()) or "start"
        if self._state != "content":
            return "", []
        text, self._buf = self._buf, ""
        return text, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self._buf = self._buf, ""
        calls = self._parse(text) if self._state == "calls" else None
        return ("", calls) if calls else (text, [])


def tool_stream(parser: str) -> Any:
    """The streaming reader for a format: feed/finish -> (content, calls)."""
    if parser == "llama3_json":
        return WholeOutputCalls(_by_prefix((PYTHON_TAG, "{")), parse_llama3_json)
    if parser == "mistral":
        return WholeOutputCalls(_mistral_head, parse_mistral)
    return HermesStream()


def parse_tool_output(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """The whole output's content (stripped; None when empty) and calls, in that format."""
    if parser == "hermes":
        return parse_hermes(text)
    reader = tool_stream(parser)
    sent, _ = reader.feed(text)
    rest, calls = reader.finish()
    return (sent + rest).strip() or None, calls
