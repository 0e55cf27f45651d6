"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

A Messages request is translated into the chat completions request it means
(`chat_request`): system and messages become chat messages (`tool_use` blocks an
assistant turn's tool calls, `tool_result` blocks tool turns), tools and tool_choice
their chat forms (`any` is "required", `tool` a named function), stop_sequences `stop`.
From there it is the chat endpoint's request: the same chat template and token ids (so
a conversation sent through either API renders the same prompt and hits the same cached
prefix), the same tool-call constraints and readers. Only the answer's shape differs:
content blocks, Anthropic's stop reasons and usage, its streaming events, and errors as
`{"type": "error", "error": {"type", "message"}}` (server/errors.py).

`output_config.format` (a JSON schema) is chat's response_format. Sampling fields the
current SDK no longer sends (temperature, top_p, top_k) are still read, e.g. from
`extra_body`. A reasoning model's think block (server/reasoning.py) is a `thinking` block
before the text; thinking blocks sent back in an assistant turn are taken and left out of
the prompt. `thinking` "enabled" caps the block at its budget_tokens (chat's
thinking_token_budget); "enabled" and "disabled" are also the template's
`enable_thinking` (chat's chat_template_kwargs, which Qwen3's template reads). Not served
(a 400 naming it): image and document blocks.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine import RequestOutput
from server.chat import chat_prompt_ids, serve_chat
from server.engine_client import EngineStream
from server.errors import bad_request
from server.messages_blocks import ContentBlocks, thinking_block, tool_input, tool_use_id
from server.protocol import MAX_TOP_K, ChatCompletionRequest
from server.request_base import (
    FunctionName,
    MaxTokens,
    NonEmptyStr,
    OpenAIBaseModel,
    server_limit,
)
from server.serving import ServingContext, StreamFormat, as_is, named_event
from server.tool_calls import OutputReading
from server.validation import check_tools

# ------------------------------------------------------------------- request schemas


class TextBlock(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(OpenAIBaseModel):
    """A tool call of an earlier assistant turn."""

    type: Literal["tool_use"]
    id: NonEmptyStr
    name: FunctionName
    input: dict[str, Any]


class ToolResultBlock(OpenAIBaseModel):
    """What a tool returned, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: NonEmptyStr
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class ThinkingBlockParam(OpenAIBaseModel):
    """An earlier turn's thinking, sent back as Anthropic's SDK loop does: taken and left
    out of the prompt (reasoning models' templates drop earlier turns' thinking too)."""

    type: Literal["thinking"]
    thinking: str | None = None
    signature: str | None = None


class RedactedThinkingBlockParam(OpenAIBaseModel):
    """Thinking Anthropic's API encrypted, sent back the same way: taken and left out.
    (One model per `type` value: the discriminator maps each value to one schema.)"""

    type: Literal["redacted_thinking"]
    data: str | None = None


# Tool results come in user turns, tool calls (and thinking) in assistant turns.
UserBlock = Annotated[TextBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[
    TextBlock | ToolUseBlock | ThinkingBlockParam | RedactedThinkingBlockParam,
    Field(discriminator="type"),
]


class UserMessage(OpenAIBaseModel):
    role: Literal["user"]
    content: str | Annotated[list[UserBlock], Field(min_length=1)]


class AssistantMessage(OpenAIBaseModel):
    role: Literal["assistant"]
    content: str | Annotated[list[AssistantBlock], Field(min_length=1)]


MessageParam = Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]


class ThinkingParam(OpenAIBaseModel):
    """Extended thinking: "enabled" caps a reasoning model's think block at budget_tokens
    (chat's thinking_token_budget; 400 where the server reads no think blocks). Either type
    is the chat template's `enable_thinking` (true or false): Qwen3's template then opens no
    think block for "disabled"; a template that does not read it renders as before."""

    model_config = ConfigDict(json_schema_extra={"allOf": [{
        "if": {"properties": {"type": {"const": "enabled"}}},
        "then": {"required": ["budget_tokens"],
                 "properties": {"budget_tokens": {"type": "integer"}}},
    }]})  # fmt: skip

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)

    @model_validator(mode="after")
    def _enabled_has_a_budget(self) -> ThinkingParam:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError('thinking "enabled" needs budget_tokens')
        return self


class ToolParam(OpenAIBaseModel):
    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoiceParam(OpenAIBaseModel):
    """`auto` (the model decides), `any` (at least one call), `tool` (that one), `none`."""

    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None  # `tool` only
    disable_parallel_tool_use: bool | None = None


class OutputFormat(OpenAIBaseModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIBaseModel):
    """Structured outputs: `format` constrains the answer to a JSON schema (chat's
    response_format json_schema); `effort` (low, medium, high) is chat's reasoning_effort,
    the chat template's variable (gpt-oss reads it); another value has no effect."""

    format: OutputFormat | None = None
    effort: str | None = None


# `tool` names one of `tools`; `any` and `tool` need tools (said here for /openapi.json).
# Each `if` matches an object with that `type` only: `properties` holds vacuously for a
# null tool_choice (which the server takes as none given), so without "type": "object"
# the spec refused `"tool_choice": null` without tools, which the server accepts.
_TOOL_CHOICE_RULES = (
    {
        "if": {"required": ["tool_choice"], "properties": {"tool_choice": {
            "type": "object", "required": ["type"],
            "properties": {"type": {"enum": ["any", "tool"]}}}}},
        "then": {"required": ["tools"],
                 "properties": {"tools": {"type": "array", "minItems": 1}}},
    },
    {
        "if": {"required": ["tool_choice"], "properties": {"tool_choice": {
            "type": "object", "required": ["type"],
            "properties": {"type": {"const": "tool"}}}}},
        "then": {"properties": {"tool_choice": {
            "required": ["name"], "properties": {"name": {"type": "string"}}}}},
    },
)  # fmt: skip


class CountTokensRequest(OpenAIBaseModel):
    """POST /v1/messages/count_tokens: the prompt a Messages request would send."""

    model_config = ConfigDict(json_schema_extra={"allOf": list(_TOOL_CHOICE_RULES)})

    model: str = Field(json_schema_extra=server_limit("model_id"))
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages. Rules beyond this schema (400 when broken), as for chat: the
    rendered prompt plus max_tokens fit the context; `tools`' names are distinct and a
    `tool` choice names one of them; the output constraint compiles (with tools and `auto`,
    the default, on a template without tools: the generic format's grammar, its schemas
    checked like any other)."""

    max_tokens: MaxTokens
    stop_sequences: list[NonEmptyStr] | None = None
    stream: bool | None = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=MAX_TOP_K)
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None  # e.g. user_id: accepted, not used


# ------------------------------------------------------------- the chat request it means


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completions request this Messages request means (see the module doc)."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system)})
    for message in req.messages:
        messages.extend(_chat_messages(message))
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in req.tools
        ]  # fmt: skip
    if req.tool_choice is not None:
        body.update(_chat_tool_choice(req.tool_choice))
    if req.thinking is not None:  # count_tokens renders the prompt the request would
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type == "enabled"}
    if isinstance(req, MessagesRequest):
        body.update(
            max_tokens=req.max_tokens, stream=req.stream, temperature=req.temperature,
            top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences,
        )  # fmt: skip
        if req.thinking is not None and req.thinking.type == "enabled":
            body["thinking_token_budget"] = _thinking_budget(req.thinking, req.max_tokens)
        effort = req.output_config.effort if req.output_config else None
        if effort in ("low", "medium", "high"):
            body["reasoning_effort"] = effort
        output_format = req.output_config.format if req.output_config else None
        if output_format is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": output_format.json_schema}}  # fmt: skip
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # a value valid here but not there: say which
        raise bad_request(f"Invalid request: {exc.errors()[0]['msg']}") from exc


def _thinking_budget(thinking: ThinkingParam, max_tokens: int) -> int:
    """An "enabled" thinking's budget, checked as Anthropic's API checks it (its minimum of
    1024 excepted: small models think in fewer)."""
    budget = thinking.budget_tokens or 0  # never None: ThinkingParam's rule for "enabled"
    if budget >= max_tokens:
        raise bad_request("max_tokens must be greater than thinking.budget_tokens",
                          param="thinking.budget_tokens")  # fmt: skip
    return budget


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _chat_messages(message: UserMessage | AssistantMessage) -> list[dict[str, Any]]:
    """One Messages turn as chat messages: a user turn's tool results become tool
    messages (in order, around its text); an assistant turn's tool_use blocks its calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if isinstance(message, AssistantMessage):
        return [_assistant_message(message.content)]
    out: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            content = _text(block.content) if block.content is not None else ""
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif out and out[-1]["role"] == "user":
            out[-1]["content"] += block.text
        else:
            out.append({"role": "user", "content": block.text})
    return out


def _assistant_message(
    blocks: list[AssistantBlock],
) -> dict[str, Any]:
    text, calls = "", []
    for block in blocks:
        if isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": arguments}})  # fmt: skip
        elif isinstance(block, TextBlock):
            text += block.text
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return message


def _chat_tool_choice(choice: ToolChoiceParam) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if choice.type == "tool":
        if choice.name is None:
            raise bad_request('tool_choice "tool" needs a `name`.', param="tool_choice.name")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


# ------------------------------------------------------------------------ the routes


class MessageUsage(BaseModel):
    """Anthropic's usage: input_tokens excludes the prompt tokens read from the cache."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: MessageUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


async def create_message(ctx: ServingContext, req: MessagesRequest, raw: Request) -> Response:
    chat = chat_request(req)
    message_id = f"msg_{uuid.uuid4().hex}"

    def view(num_prompt: int, reading: OutputReading) -> _MessagesView:
        return _MessagesView(ctx, chat, message_id, num_prompt, reading)

    return await serve_chat(ctx, chat, message_id, "/v1/messages", view, raw, ANTHROPIC_STREAM)


async def count_tokens(ctx: ServingContext, req: CountTokensRequest) -> CountTokensResponse:
    chat = chat_request(req)
    ctx.check_model(chat.model)
    check_tools(chat)
    return CountTokensResponse(input_tokens=len(await chat_prompt_ids(ctx, chat)))


def _usage(num_prompt: int, out: RequestOutput) -> MessageUsage:
    cached = min(out.num_cached_tokens, num_prompt)
    return MessageUsage(input_tokens=num_prompt - cached, output_tokens=len(out.token_ids),
                        cache_read_input_tokens=cached)  # fmt: skip


def _stop_reason(out: RequestOutput, made_calls: bool) -> str:
    if out.finish_reason == "length":
        return "max_tokens"
    if made_calls:
        return "tool_use"
    return "stop_sequence" if out.stop_string is not None else "end_turn"


class _MessagesView:
    """Engine output as a Message, or as Anthropic's stream of events."""

    def __init__(
        self,
        ctx: ServingContext,
        chat: ChatCompletionRequest,
        message_id: str,
        num_prompt: int,
        reading: OutputReading,
    ) -> None:
        self.chat = chat
        self.reading = reading
        self.request_id = message_id
        self.num_prompt = num_prompt
        self.model = ctx.served_model_name
        self.created = int(time.time())

    def response(self, finals: dict[str, RequestOutput]) -> MessageResponse:
        out = finals[f"{self.request_id}-0"]
        message = self.reading.reader(self.chat).message(out.text)
        content: list[dict[str, Any]] = []
        if message.reasoning_content is not None:  # a think block: Anthropic's thinking
            content.append(thinking_block(message.reasoning_content))
        if message.content:
            content.append({"type": "text", "text": message.content})
        for call in message.tool_calls or ():
            content.append({"type": "tool_use", "id": tool_use_id(call.id),
                            "name": call.function.name, "input": tool_input(call.function.arguments)})  # fmt: skip
        return MessageResponse(
            id=self.request_id, model=self.model, content=content,
            stop_reason=_stop_reason(out, bool(message.tool_calls)),
            stop_sequence=out.stop_string, usage=_usage(self.num_prompt, out),
        )  # fmt: skip

    async def chunks(self, stream: EngineStream) -> AsyncIterator[str]:
        reader = self.reading.reader(self.chat)
        blocks = ContentBlocks()
        started = False
        async for out in stream:
            if not started:
                started = True
                usage = _usage(self.num_prompt, out).model_dump()
                usage["output_tokens"] = 0
                yield named_event("message_start", {"type": "message_start", "message": {
                    "id": self.request_id, "type": "message", "role": "assistant",
                    "model": self.model, "content": [], "stop_reason": None,
                    "stop_sequence": None, "usage": usage}})  # fmt: skip
            delta = reader.feed(out.new_text)
            for chunk in blocks.events(delta):
                yield chunk
            if out.finished:
                for chunk in blocks.events(reader.finish()):
                    yield chunk
                for chunk in blocks.close():
                    yield chunk
                reason = _stop_reason(out, reader.made_calls)
                yield named_event("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": out.stop_string},
                    "usage": {"output_tokens": len(out.token_ids)}})  # fmt: skip
                yield named_event("message_stop", {"type": "message_stop"})


# Anthropic's stream: its named events as the view writes them, an `error` event in its
# shape if the stream fails, no `[DONE]` (it ends with message_stop).
ANTHROPIC_STREAM = StreamFormat(as_is, lambda error: named_event("error", error.anthropic_body()))
