"""The Responses API's output items (`reasoning`, `message`, `function_call`) and the
stream events that build them from chat deltas (server/responses.py's view sends them)."""

from __future__ import annotations

import json
import uuid
from typing import Any


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(id_: str, text: str, status: str) -> dict[str, Any]:
    """A think block as the Responses API's reasoning item: its text as reasoning_text
    content (there is no summary: nothing here summarises)."""
    return {"type": "reasoning", "id": id_, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def message_item(id_: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": id_, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}  # fmt: skip


def call_item(id_: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": id_, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


class OutputItems:
    """Chat deltas (reasoning, content, tool-call pieces) as output item events: an item
    opens when its kind of delta first arrives and closes when another kind (or the end)
    comes."""

    def __init__(self, event: Any) -> None:
        self.event = event
        self.output: list[dict[str, Any]] = []  # the items, completed as they close
        self.open: dict[str, Any] | None = None

    def events(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            if self.open is None or self.open["type"] != "reasoning":
                out += self._start(reasoning_item(item_id("rs"), "", "in_progress"))
            self.open["content"][0]["text"] += delta["reasoning_content"]
            out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                  output_index=len(self.output), content_index=0,
                                  delta=delta["reasoning_content"]))  # fmt: skip
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                out += self._start(message_item(item_id("msg"), "", "in_progress"))
                out.append(self._part("response.content_part.added", ""))
            self.open["content"][0]["text"] += delta["content"]
            out.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                  output_index=len(self.output), content_index=0,
                                  delta=delta["content"], logprobs=[]))  # fmt: skip
        for call in delta.get("tool_calls", ()):
            if call.get("id"):  # a new call: its own item
                out += self._start(call_item(item_id("fc"), call["id"],
                                              call["function"]["name"], "", "in_progress"))  # fmt: skip
            arguments = call.get("function", {}).get("arguments")
            if arguments and self.open is not None:
                self.open["arguments"] += arguments
                out.append(self.event("response.function_call_arguments.delta",
                                      item_id=self.open["id"], output_index=len(self.output),
                                      delta=arguments))  # fmt: skip
        return out

    def close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output)
        item["status"] = "completed"
        if item["type"] == "reasoning":
            out = [self.event("response.reasoning_text.done", item_id=item["id"],
                              output_index=index, content_index=0,
                              text=item["content"][0]["text"])]  # fmt: skip
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            out = [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=text, logprobs=[])]  # fmt: skip
            self.open = item
            out.append(self._part("response.content_part.done", text))
            self.open = None
        else:
            out = [self.event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, name=item["name"],
                              arguments=item["arguments"])]  # fmt: skip
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return out

    def _start(self, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self.open = item
        added = json.loads(json.dumps(item))  # as it was when added, not as it grows
        return [*out, self.event("response.output_item.added", output_index=len(self.output),
                                 item=added)]  # fmt: skip

    def _part(self, kind: str, text: str) -> str:
        assert self.open is not None
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return self.event(kind, item_id=self.open["id"], output_index=len(self.output),
                          content_index=0, part=part)  # fmt: skip
