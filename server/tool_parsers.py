"""Model output text -> OpenAI tool calls, whole or streamed.

Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks amid ordinary text
(Qwen2.5 / Hermes templates, tool_choice="auto"), and a JSON array of calls written under a
grammar (tool_choice="required"). "arguments" and "parameters" are synonyms in both, and the
arguments may arrive as a JSON string holding the object, since some models quote them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from server import json_body

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace
_BLOCK = re.compile(re.escape(OPEN_TAG) + "(.*?)" + re.escape(CLOSE_TAG), re.DOTALL)


def new_call() -> str:
    """A fresh tool call id in OpenAI's shape: "call_" and 24 hex characters."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # json.dumps(obj, ensure_ascii=False) of the arguments object
    id: str = field(default_factory=new_call)


def _arguments(obj: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments object; ValueError when it is not an object (or a string holding one)."""
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(args, str):
        args = json_body.loads(args)  # not JSON, or nested past the limit: a ValueError
    if not isinstance(args, dict):
        raise ValueError(f"arguments must be a JSON object, got {type(args).__name__}")
    return args


def call_from_object(obj: Any) -> ToolCall:
    """A ToolCall from a decoded {name, arguments|parameters} object; ValueError naming the fault."""
    if not isinstance(obj, dict):
        raise ValueError(f"a call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str):
        raise ValueError('a call needs a string "name"')
    return ToolCall(name=name, arguments=json.dumps(_arguments(obj), ensure_ascii=False))


def _call_from_block(body: str) -> ToolCall | None:
    """The call in a `<tool_call>` block's body, or None so the caller keeps the block as text."""
    try:
        return call_from_object(json_body.loads(body))
    except ValueError:
        return None


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Content outside the blocks (stripped; None when nothing is left) and the calls in order.

    A block whose JSON does not parse, or has no string "name", is left in the content as it
    was written (never dropped, never an exception); so is an unterminated `<tool_call>`.
    """
    parts: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    for match in _BLOCK.finditer(text):
        parts.append(text[pos : match.start()])
        call = _call_from_block(match.group(1))
        if call is None:
            parts.append(match.group(0))
        else:
            calls.append(call)
        pos = match.end()
    parts.append(text[pos:])
    return "".join(parts).strip() or None, calls


def _partial_tag_len(text: str) -> int:
    """Length of the longest end of `text` that could still grow into OPEN_TAG."""
    for n in range(min(len(text), len(OPEN_TAG) - 1), 0, -1):
        if text.endswith(OPEN_TAG[:n]):
            return n
    return 0


class HermesStream:
    """Incremental parse_hermes.

    feed(delta) -> (content safe to send now, calls completed by this delta);
    finish() -> (the rest: held-back text, an unterminated block as content).
    Outside a block only a trailing prefix of "<tool_call>" is held back, so text such as
    "<tools>" or "a < b" goes out as soon as the next character rules the tag out. The
    joined content equals parse_hermes's before its strip: this class never strips, so the
    caller decides what to do with whitespace around blocks.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False  # after an OPEN_TAG whose CLOSE_TAG has not arrived yet

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._buf += delta
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self._inside:
                start = self._buf.find(OPEN_TAG)
                if start < 0:
                    keep = len(self._buf) - _partial_tag_len(self._buf)
                    content.append(self._buf[:keep])
                    self._buf = self._buf[keep:]
                    break
                content.append(self._buf[:start])
                self._buf = self._buf[start + len(OPEN_TAG) :]
                self._inside = True
            else:
                end = self._buf.find(CLOSE_TAG)
                if end < 0:
                    break
                body = self._buf[:end]
                self._buf = self._buf[end + len(CLOSE_TAG) :]
                self._inside = False
                call = _call_from_block(body)
                if call is None:
                    content.append(OPEN_TAG + body + CLOSE_TAG)
                else:
                    calls.append(call)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest = (OPEN_TAG if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        return rest, []


class CallArrayStream:
    """Incremental splitter for the JSON array of calls (the whole text is one delta).

    feed(delta) -> the calls whose object closed in this delta. A structural fault that more
    text cannot fix (no '[' first, no ',' or ']' after an element, an element that is not a
    call) raises ValueError; text after the closing ']' is ignored.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._pos = 0
        self._state = "open"  # open -> first (element or ']') -> element <-> separator -> done
        self._decoder = json.JSONDecoder()

    def feed(self, delta: str) -> list[ToolCall]:
        self._buf += delta
        calls: list[ToolCall] = []
        while self._state != "done":
            self._pos = _SPACE.match(self._buf, self._pos).end()
            if self._pos >= len(self._buf):
                break
            char = self._buf[self._pos]
            if self._state == "open":
                if char != "[":
                    raise ValueError(f"tool calls must be a JSON array, got {char!r} first")
                self._pos, self._state = self._pos + 1, "first"
            elif (self._state == "first" and char == "]") or self._state == "separator":
                if char not in ",]":
                    raise ValueError(f"expected ',' or ']' after a call, got {char!r}")
                self._pos += 1
                self._state = "element" if char == "," else "done"
            else:
                try:
                    obj, self._pos = self._decoder.raw_decode(self._buf, self._pos)
                except json.JSONDecodeError:
                    # Incomplete and malformed look alike here; under the grammar it is the former.
                    break
                except RecursionError:  # the parser's own limit on nesting (~1,000 levels)
                    raise ValueError("a tool call is nested too deeply to read") from None
                calls.append(call_from_object(obj))
                self._state = "separator"
        return calls
