"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API.

As for Anthropic's Messages (server/messages.py), a Responses request is turned into the
chat completions request it means (`chat_request`): `instructions` a system message,
then the stored conversation of `previous_response_id`, then `input` (a string, or
items: messages, `function_call` items as an assistant turn's tool calls,
`function_call_output` items as tool turns); `tools` (function tools) and
`tool_choice`, `text.format` (json_schema, json_object) as response_format,
`max_output_tokens` as max_tokens, `chat_template_kwargs` (vLLM's, as on chat) as it is.
From there the chat path runs: same template, same tokens and cached prefix, same
constrained tool calls. The answer is a Response: output items (`message` with
`output_text`, `function_call`), `status` `completed` or `incomplete`
(max_output_tokens), usage with cached tokens; streamed as the Responses events
(server/responses_items.py). A reasoning model's think block (server/reasoning.py)
is a `reasoning` item before the message; reasoning items sent back in `input` are taken
and left out of the prompt. With `store` (the default) the response and its conversation
are kept in a bounded store (server/response_store.py) for `previous_response_id`, GET and
DELETE.

`reasoning.effort` is the chat template's `reasoning_effort` (gpt-oss reads it). Not
served, a 400 naming it: built-in tools (web search, file search...), reasoning
summaries, background mode, `truncation: auto`, image and file inputs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, ValidationError

from engine import RequestOutput
from server.chat import serve_chat
from server.engine_client import EngineStream
from server.errors import OpenAIError, bad_request, not_found
from server.protocol import (
    TEMPLATE_KWARGS_NOTE,
    ChatCompletionRequest,
    ReasoningEffort,
    TemplateKwargs,
)
from server.request_base import (
    FunctionName,
    MaxTokens,
    NonEmptyStr,
    OpenAIBaseModel,
    server_limit,
)
from server.responses_items import OutputItems, call_item, item_id, message_item, reasoning_item
from server.serving import ServingContext, StreamFormat, as_is, named_event
from server.tool_calls import OutputReading

# ------------------------------------------------------------------- request schemas


class InputText(OpenAIBaseModel):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(OpenAIBaseModel):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]


class FunctionCallItem(OpenAIBaseModel):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: FunctionName
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenAIBaseModel):
    """What the caller's function returned for `call_id`."""

    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None


class ReasoningInputItem(OpenAIBaseModel):
    """A reasoning item of an earlier turn, sent back as agents do: taken and left out of
    the prompt (a model's chat template drops earlier turns' reasoning too)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] | None = None
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningInputItem


class FunctionTool(OpenAIBaseModel):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    name: FunctionName


class TextFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None


class Reasoning(OpenAIBaseModel):
    """`effort` is chat's `reasoning_effort` (the chat template's variable: gpt-oss reads
    it); no summaries."""

    effort: ReasoningEffort | None = None
    summary: None = None


# `json_schema` needs its schema; `required` and a named function need tools.
_RULES = (
    {
        "if": {"required": ["text"], "properties": {"text": {
            "required": ["format"], "properties": {"format": {
                "required": ["type"], "properties": {"type": {"const": "json_schema"}}}}}}},
        "then": {"properties": {"text": {"properties": {"format": {
            "required": ["schema"], "properties": {"schema": {"type": "object"}}}}}}},
    },
    {
        "if": {"required": ["tool_choice"], "properties": {"tool_choice": {
            "anyOf": [{"const": "required"}, {"type": "object"}]}}},
        "then": {"required": ["tools"],
                 "properties": {"tools": {"type": "array", "minItems": 1}}},
    },
)  # fmt: skip


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses. Rules beyond this schema (400 when broken), as for chat: the
    rendered prompt plus max_output_tokens fit the context; tool names are distinct and a
    named tool_choice names one of them; the output constraint compiles (with tools and
    `auto`, the default, on a template without tools: the generic format's grammar). An
    unknown (or expired, or unstored) `previous_response_id` is a 404."""

    model_config = {"json_schema_extra": {"allOf": list(_RULES)}}

    model: str | None = Field(default=None, json_schema_extra=server_limit("model"))
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: NonEmptyStr | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    store: bool | None = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: Reasoning | None = None
    # chat's (vLLM's) cap on a reasoning model's think block; the API itself has no budget
    thinking_token_budget: int | None = Field(default=None, ge=0, le=2**31 - 1)
    chat_template_kwargs: TemplateKwargs | None = Field(
        default=None, description=TEMPLATE_KWARGS_NOTE
    )
    background: Literal[False] | None = None
    truncation: Literal["disabled"] | None = None


# ------------------------------------------------------------- the chat request it means


def conversation_of(req: ResponsesRequest, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a request: the earlier turns, then its input (no instructions:
    they apply to this request only, as OpenAI's do)."""
    messages = list(history)
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for item in req.input:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn's calls
                # A new dict: `last` may be a stored response's turn, shared with its store.
                messages[-1] = {**last, "tool_calls": [*last.get("tool_calls", ()), call]}
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output)})  # fmt: skip
    return messages


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def chat_request(
    req: ResponsesRequest, conversation: list[dict[str, Any]]
) -> ChatCompletionRequest:
    messages = list(conversation)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls,
        "thinking_token_budget": req.thinking_token_budget,
        "chat_template_kwargs": req.chat_template_kwargs,
        "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
    }  # fmt: skip
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(include={
                "name", "description", "parameters", "strict"}, exclude_none=True)}
            for t in req.tools
        ]  # fmt: skip
    if isinstance(req.tool_choice, FunctionToolChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "output", "schema": fmt.json_schema, "strict": fmt.strict}}  # fmt: skip
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValidationError as exc:  # a value valid here but not there: say which
        raise bad_request(f"Invalid request: {exc.errors()[0]['msg']}") from exc


# ------------------------------------------------------------------------ the routes


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """A Response as OpenAI's SDK reads it (the fields this server sets)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: dict[str, str] | None = None
    error: None = None
    model: str
    instructions: str | None = None
    output: list[dict[str, Any]]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Any
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    store: bool
    metadata: dict[str, str]
    user: str | None = None
    usage: ResponseUsage | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


def unknown_response(response_id: str, param: str | None = None) -> OpenAIError:
    return not_found(f"No stored response with id {response_id!r}: it was never stored "
                     "(store: false), was deleted, or has expired.", param=param)  # fmt: skip


async def create_response(ctx: ServingContext, req: ResponsesRequest, raw: Request) -> Response:
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = ctx.responses.get(req.previous_response_id)
        if stored is None:
            raise unknown_response(req.previous_response_id, param="previous_response_id")
        history = stored.conversation
    conversation = conversation_of(req, history)
    chat = chat_request(req, conversation)
    response_id = f"resp_{uuid.uuid4().hex}"

    def view(num_prompt: int, reading: OutputReading) -> _ResponsesView:
        return _ResponsesView(ctx, req, chat, response_id, num_prompt, conversation, reading)

    return await serve_chat(ctx, chat, response_id, "/v1/responses", view, raw, RESPONSES_STREAM)


def _turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as the assistant turn a follow-up's conversation continues from."""
    text = "".join(part["text"] for item in output if item["type"] == "message"
                   for part in item["content"])  # fmt: skip
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]  # fmt: skip
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


class _ResponsesView:
    """Engine output as a Response or as the Responses events; stored when asked."""

    def __init__(self, ctx: ServingContext, req: ResponsesRequest, chat: ChatCompletionRequest,
                 response_id: str, num_prompt: int, conversation: list[dict[str, Any]],
                 reading: OutputReading) -> None:  # fmt: skip
        self.ctx = ctx
        self.reading = reading
        self.req = req
        self.chat = chat
        self.request_id = response_id
        self.num_prompt = num_prompt
        self.conversation = conversation
        self.created = int(time.time())
        self.sequence = 0

    def _response(self, status: str, output: list[dict[str, Any]],
                  out: RequestOutput | None = None) -> ResponseObject:  # fmt: skip
        req = self.req
        tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools or ()]
        choice = req.tool_choice
        fmt = req.text.format if req.text and req.text.format else None
        usage = None
        if out is not None:
            cached = min(out.num_cached_tokens, self.num_prompt)
            usage = ResponseUsage(
                input_tokens=self.num_prompt, input_tokens_details={"cached_tokens": cached},
                output_tokens=len(out.token_ids), output_tokens_details={"reasoning_tokens": 0},
                total_tokens=self.num_prompt + len(out.token_ids),
            )  # fmt: skip
        return ResponseObject(
            id=self.request_id, created_at=self.created, status=status,
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            model=self.ctx.served_model_name, instructions=req.instructions, output=output,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id, max_output_tokens=req.max_output_tokens,
            temperature=req.temperature, top_p=req.top_p,
            tool_choice=choice.model_dump() if isinstance(choice, BaseModel) else (choice or "auto"),
            tools=tools,
            text={"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"}},
            store=req.store is not False, metadata=req.metadata or {}, user=req.user, usage=usage,
        )  # fmt: skip

    def _finish(self, out: RequestOutput, output: list[dict[str, Any]]) -> ResponseObject:
        status = "incomplete" if out.finish_reason == "length" else "completed"
        response = self._response(status, output, out)
        if self.req.store is not False:
            self.ctx.responses.put(response.model_dump(), [*self.conversation, _turn(output)])
        return response

    def response(self, finals: dict[str, RequestOutput]) -> ResponseObject:
        out = finals[f"{self.request_id}-0"]
        message = self.reading.reader(self.chat).message(out.text)
        status = "incomplete" if out.finish_reason == "length" else "completed"
        output = []
        if message.reasoning_content is not None:  # a think block: a reasoning item
            output.append(reasoning_item(item_id("rs"), message.reasoning_content, "completed"))
        if message.content:
            output.append(message_item(item_id("msg"), message.content, status))
        for call in message.tool_calls or ():
            output.append(call_item(item_id("fc"), call.id, call.function.name,
                                     call.function.arguments, "completed"))  # fmt: skip
        return self._finish(out, output)

    def _event(self, kind: str, **fields: Any) -> str:
        self.sequence += 1
        return named_event(kind, {"type": kind, "sequence_number": self.sequence - 1, **fields})

    async def chunks(self, stream: EngineStream) -> AsyncIterator[str]:
        started = self._response("in_progress", []).model_dump()
        yield self._event("response.created", response=started)
        yield self._event("response.in_progress", response=started)
        reader = self.reading.reader(self.chat)
        items = OutputItems(self._event)
        async for out in stream:
            for chunk in items.events(reader.feed(out.new_text)):
                yield chunk
            if out.finished:
                for chunk in items.events(reader.finish()):
                    yield chunk
                for chunk in items.close():
                    yield chunk
                final = self._finish(out, items.output)
                kind = (
                    "response.completed" if final.status == "completed" else "response.incomplete"
                )
                yield self._event(kind, response=final.model_dump())


def _error_event(error: OpenAIError) -> str:
    body = {"type": "error", "code": error.code, "message": error.message,
            "param": error.param, "sequence_number": 0}  # fmt: skip
    return named_event("error", body)


# The Responses stream: its named events as the view writes them, an `error` event if it
# fails, no `[DONE]`.
RESPONSES_STREAM = StreamFormat(as_is, _error_event)


def get_response(ctx: ServingContext, response_id: str) -> dict[str, Any]:
    stored = ctx.responses.get(response_id)
    if stored is None:
        raise unknown_response(response_id)
    return stored.body


def delete_response(ctx: ServingContext, response_id: str) -> DeletedResponse:
    if not ctx.responses.delete(response_id):
        raise unknown_response(response_id)
    return DeletedResponse(id=response_id)
