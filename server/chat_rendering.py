"""Chat messages as the chat template's input: the first half of rendering a chat.

A request's messages become plain `{role, content}` dicts: OpenAI's roles folded to the
ones templates know, text parts joined into one string, an earlier turn's tool calls
with their arguments as objects. Only text is served: any other content part, and the
message fields in `UNSUPPORTED_MESSAGE_FIELDS`, are a 400 naming the part or field.
The second half, applying the model's template (on its render threads, within its
bounds: server/chat_renderer.py) and encoding the text, is on the tokenizer's side
(server/tokens.py: `apply_chat_template`, `encode_chat`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from server import json_body
from server.errors import bad_request
from server.protocol import ChatMessageParam, ToolCallParam
from server.validation import reject_unsupported_message_fields

# OpenAI's roles as chat templates know them ("developer" is a newer name for "system").
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}  # fmt: skip


def conversation(messages: Sequence[ChatMessageParam]) -> list[dict[str, Any]]:
    """The messages as plain {role, content} dicts for the chat template. A tool result
    without a `name` (OpenAI's shape has none) gets the name of the call it answers:
    Hermes' and Qwen2.5's templates refuse a tool message that has none."""
    plain = [plain_message(i, m) for i, m in enumerate(messages)]
    called = {c.id: c.function.name for m in messages for c in m.tool_calls or ()}
    for message in plain:
        if message["role"] == "tool" and "name" not in message:
            name = called.get(message.get("tool_call_id"))
            if name is not None:
                message["name"] = name
    return plain


def plain_message(i: int, m: ChatMessageParam) -> dict[str, Any]:
    """Message `i` as the chat template's dict; 400 naming what it cannot take."""
    param = f"messages.{i}"
    role = _ROLES[m.role]
    reject_unsupported_message_fields(m, param)
    message: dict[str, Any] = {"role": role, "content": _content(m, role, param)}
    if m.name:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [_template_tool_call(c) for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def _content(m: ChatMessageParam, role: str, param: str) -> str:
    """The message's text; only an assistant turn (one that made tool calls) may have none."""
    if m.content is None:
        if role != "assistant":
            raise bad_request("content must not be null.", param=f"{param}.content")
        return ""
    if isinstance(m.content, str):
        return m.content
    return "".join(_text_part(part, f"{param}.content.{j}") for j, part in enumerate(m.content))


def _template_tool_call(call: ToolCallParam) -> dict[str, Any]:
    """A call as chat templates expect it: arguments as an object (Qwen's template writes
    them with `tojson`, which would quote a JSON string a second time). Arguments that are
    not a JSON object (a call the model cut short) stay the text they were."""
    arguments: Any = call.function.arguments
    try:
        parsed = json_body.loads(arguments)
    except ValueError:  # not JSON, or nested past the limit: kept as the text it was
        parsed = None
    if isinstance(parsed, dict):
        arguments = parsed
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": arguments}}  # fmt: skip


def _text_part(part: dict[str, Any], param: str) -> str:
    if part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise bad_request(
            f"content part type {part.get('type')!r} is not supported; only text parts.",
            param=param,
        )
    return part["text"]
