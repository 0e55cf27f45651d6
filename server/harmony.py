"""gpt-oss' harmony format read out of the output: reasoning, the answer and tool calls.

gpt-oss writes its turn as messages, each a header and a body between special tokens,
after the generation prompt's `<|start|>assistant`:

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>final<|message|>Paris.<|return|>

or, for a call, a header naming its recipient (before or after the channel) and a JSON body:

    <|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The analysis channel is the reasoning (`reasoning_content`, a reasoning item, a thinking
block); a message to `functions.NAME` is a tool call; every other message (final, and
commentary preambles) is the content. Output without any header (a constrained answer) is
all content. The markers are special tokens, so a harmony request's text keeps them
(`skip_special_tokens` off: server/chat.py). Built-in tools (`browser.*`, `python`) are not
served: a message to them is dropped.

Under tool_choice "required" or a named function the output is held to the format too
(`call_constraint`): one call message on the commentary channel, its body the function's
arguments, ended by `<|call|>` (which ends gpt-oss' turn, so one call a turn).
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine import StructuredOutputs
from server.generic_tools import json_format
from server.reasoning import partial_suffix
from server.tool_parsers import ToolCall, call_from_object

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CALL, RETURN = "<|call|>", "<|return|>"
MESSAGE_ENDS = (END, CALL, RETURN)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
FUNCTIONS = "functions."


def call_constraint(tools: list[tuple[str, dict[str, Any]]]) -> StructuredOutputs:
    """One harmony call message to one of ``tools`` ((name, parameters schema) pairs): the
    header fixed but for the name, the body that function's arguments."""
    tags = [{"type": "tag", "content": json_format(schema), "end": CALL,
             "begin": f"{CHANNEL}commentary to={FUNCTIONS}{name} <|constrain|>json{MESSAGE}"}
            for name, schema in tools]  # fmt: skip
    form = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    tag = {"type": "structural_tag", "format": form}
    return StructuredOutputs("structural_tag", json.dumps(tag, ensure_ascii=False))


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could still grow into one of `markers`."""
    return max(partial_suffix(text, marker) for marker in markers)


class HarmonyStream:
    """Output text, whole or streamed, read as harmony messages.

    feed(delta) -> (reasoning, content, calls) safe to send now; finish() -> the rest. A
    header is held until its `<|message|>`; in a body only what could be the start of a
    marker is held; a call is sent whole when its message ends.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._state = "start"  # -> "header" -> "body" -> "between" -> "header" ...
        self._channel: str | None = None
        self._recipient: str | None = None
        self._call_body = ""

    def feed(self, delta: str) -> tuple[str, str, list[ToolCall]]:
        self._buf += delta
        out: tuple[list[str], list[str], list[ToolCall]] = ([], [], [])
        while self._step(out):
            pass
        return "".join(out[0]), "".join(out[1]), out[2]

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        """The rest: a body cut short is sent as it stands (a call whose arguments parse);
        a header that never reached its body is dropped, unless no header came at all."""
        reasoning, content, calls = self.feed("")
        rest, self._buf = self._buf, ""
        if self._state == "body":
            r, c, more = self._route(rest, ended=True)
            reasoning, content, calls = reasoning + r, content + c, calls + more
        elif self._state == "start":
            content += rest
        return reasoning, content, calls

    def _step(self, out: tuple[list[str], list[str], list[ToolCall]]) -> bool:
        """Consume what the buffer holds for the current state; whether to go on."""
        if self._state == "start":
            head = self._buf.lstrip()
            if not head:
                return False
            if head.startswith((CHANNEL, START, "to=")):
                self._buf, self._state = head.removeprefix(START), "header"
                return True
            if any(m.startswith(head) for m in (CHANNEL, START, "to=")):
                return False  # may still open a header
            self._state, self._channel, self._recipient = "body", "final", None
            return True
        if self._state == "between":
            at = self._buf.find(START)
            if at < 0:
                self._buf = self._buf[len(self._buf) - _held(self._buf, (START,)) :]
                return False
            self._buf, self._state = self._buf[at + len(START) :], "header"
            return True
        if self._state == "header":
            at = self._buf.find(MESSAGE)
            if at < 0:
                return False
            self._open(self._buf[:at])
            self._buf, self._state = self._buf[at + len(MESSAGE) :], "body"
            return True
        ends = [(i, m) for m in MESSAGE_ENDS if (i := self._buf.find(m)) >= 0]
        if ends:
            at, marker = min(ends)
            body, self._buf, self._state = self._buf[:at], self._buf[at + len(marker) :], "between"
            self._emit(out, *self._route(body, ended=True))
            return True
        keep = len(self._buf) - _held(self._buf, MESSAGE_ENDS)
        body, self._buf = self._buf[:keep], self._buf[keep:]
        self._emit(out, *self._route(body, ended=False))
        return False

    def _open(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._channel = channel.group(1) if channel else "final"
        self._recipient = recipient.group(1) if recipient else None
        self._call_body = ""

    def _route(self, body: str, ended: bool) -> tuple[str, str, list[ToolCall]]:
        """A piece of the current body as (reasoning, content, calls)."""
        if self._recipient is None:
            return (body, "", []) if self._channel == "analysis" else ("", body, [])
        self._call_body += body
        if not ended:
            return "", "", []
        if not self._recipient.startswith(FUNCTIONS):
            return "", "", []  # a built-in tool's message: not served
        name = self._recipient[len(FUNCTIONS) :]
        try:
            return "", "", [call_from_object({"name": name, "arguments": self._call_body})]
        except ValueError:  # not a JSON object: the text stays visible as content
            return "", self._call_body, []

    @staticmethod
    def _emit(out, reasoning: str, content: str, calls: list[ToolCall]) -> None:
        out[0].append(reasoning)
        out[1].append(content)
        out[2].extend(calls)


def parse_harmony(text: str) -> tuple[str | None, str, list[ToolCall]]:
    """The whole output's reasoning (None without an analysis message), content and calls."""
    stream = HarmonyStream()
    reasoning, content, calls = stream.feed(text)
    r, c, more = stream.finish()
    reasoning += r
    return (reasoning or None), (content + c).strip(), calls + more
