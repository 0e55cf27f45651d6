"""The Messages API's content blocks (`thinking`, `text`, `tool_use`) and the stream events
that build them from chat deltas (server/messages.py's view sends them)."""

from __future__ import annotations

import json
from typing import Any

from server.serving import named_event


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def thinking_block(text: str) -> dict[str, Any]:
    # No signature: nothing here is signed; the field is there because clients read it.
    return {"type": "thinking", "thinking": text, "signature": ""}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is ({} if cut short)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class ContentBlocks:
    """Chat deltas (reasoning, content, tool-call pieces) as content block events: a block
    opens when its kind of delta first arrives and closes when another kind (or the end)
    comes."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # "thinking", "text" or "tool_use" while one is open

    def events(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            if self.kind != "thinking":
                out += self._open(thinking_block(""))
            out.append(self._delta({"type": "thinking_delta",
                                    "thinking": delta["reasoning_content"]}))  # fmt: skip
        if delta.get("content"):
            if self.kind != "text":
                out += self._open({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls", ()):
            if call.get("id"):  # a new call: its own block
                function = call["function"]
                out += self._open({"type": "tool_use", "id": tool_use_id(call["id"]),
                                   "name": function["name"], "input": {}})  # fmt: skip
            arguments = call.get("function", {}).get("arguments")
            if arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return out

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [
            named_event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        ]

    def _open(self, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.kind = block["type"]
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*out, named_event("content_block_start", start)]

    def _delta(self, delta: dict[str, Any]) -> str:
        body = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return named_event("content_block_delta", body)
