"""POST /v1/chat/completions: messages through the model's chat template, n choices.

Streaming sends, per choice, a first chunk with `delta: {"role": "assistant",
"content": ""}`, then content and tool-call deltas, and a last chunk carrying its
`finish_reason`; then the usage chunk if asked, then `[DONE]`. Tools and output
constraints: `server/tool_calls.py`.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response

from engine import RequestOutput, ThinkingBudget, TokenLogprob
from server.chat_rendering import conversation
from server.engine_client import EngineStream
from server.errors import bad_request
from server.generic_tools import declares_tools
from server.output_schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    UsageInfo,
    make_usage,
)
from server.protocol import ChatCompletionRequest
from server.reasoning import ReasoningMode, reasoning_mode, resolve_parser, thinking_budget
from server.serving import (
    OPENAI_STREAM,
    ResponseView,
    ServingContext,
    StreamFormat,
    check_request,
    choice_index,
    clamp_logprob,
    compile_constraint,
    engine_requests_for_prompt,
    respond,
)
from server.tokens import TokenStrings, encode_chat
from server.tool_calls import (
    OutputReading,
    finish_reason,
    merge_deltas,
    output_constraint,
    template_input,
)
from server.tool_formats import resolve_tool_parser
from server.validation import check_chat_supported


async def create_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, raw_request: Request
) -> Response:
    request_id = f"chatcmpl-{uuid.uuid4().hex}"

    def view(num_prompt: int, reading: OutputReading) -> _ChatView:
        return _ChatView(ctx, req, request_id, num_prompt, reading)

    return await serve_chat(ctx, req, request_id, "/v1/chat/completions", view, raw_request)


async def chat_prompt_text(ctx: ServingContext, req: ChatCompletionRequest) -> str:
    """The request's messages and tools rendered by the chat template (on the model's
    render threads, within its bounds: server/chat_renderer.py), its chat_template_kwargs
    as the template's extra variables (server/tool_calls.py: how tools, calls and results
    are shown on a template that has no place for them)."""
    template = getattr(ctx.tokenizer, "chat_template", None)
    messages, tools = template_input(req, conversation(req.messages), template)
    return await ctx.chat_renderer.render(messages, req.add_generation_prompt is not False,
                                          tools, req.template_kwargs())  # fmt: skip


async def chat_prompt_ids(ctx: ServingContext, req: ChatCompletionRequest) -> list[int]:
    return encode_chat(ctx.tokenizer, await chat_prompt_text(ctx, req))


def tool_parser_for(ctx: ServingContext, generic: bool) -> str:
    """The tool-call format the output is read in (the generic format's is Hermes')."""
    if generic:
        return "hermes"
    return resolve_tool_parser(ctx.tool_call_parser, getattr(ctx.tokenizer, "chat_template", None))


def output_reading(
    ctx: ServingContext, prompt_text: str, constrained: bool, tool_parser: str
) -> OutputReading:
    """How the output is read: its reasoning (server/reasoning.py; under an output
    constraint the output is the constrained text from its first token, never inside a
    think block) and its tool-call format (`tool_parser_for`)."""
    template = getattr(ctx.tokenizer, "chat_template", None)
    mode = reasoning_mode(resolve_parser(ctx.reasoning_parser, template), prompt_text)
    return OutputReading(ReasoningMode(mode.enabled) if constrained else mode, tool_parser)


async def serve_chat(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    request_id: str,
    endpoint: str,
    make_view: Callable[[int, OutputReading], ResponseView],
    raw_request: Request,
    fmt: StreamFormat = OPENAI_STREAM,
) -> Response:
    """A chat request through the engine, answered by the view `make_view(prompt tokens,
    output reading)` makes: the one path of chat completions and of the APIs translated
    into it (Anthropic's Messages, OpenAI's Responses), so a conversation renders to the
    same tokens in each and its output is read the same way."""
    check_request(ctx, req, endpoint, 1, check_chat_supported)
    generic = not declares_tools(getattr(ctx.tokenizer, "chat_template", None))
    tool_parser = tool_parser_for(ctx, generic)
    constraint = output_constraint(req, generic, tool_parser == "harmony")
    prompt_text = await chat_prompt_text(ctx, req)
    prompt_ids = encode_chat(ctx.tokenizer, prompt_text)
    reading = output_reading(ctx, prompt_text, constraint is not None, tool_parser)
    if reading.tool_parser == "harmony":  # its channels are special tokens: keep them
        req = req.model_copy(update={"skip_special_tokens": False})
    thinking = _thinking_budget(ctx, req, reading) if constraint is None else None
    structured = await compile_constraint(ctx, constraint)
    engine_requests = engine_requests_for_prompt(
        ctx, req, request_id, 0, prompt_ids, req.requested_max_tokens(), req.num_logprobs(),
        "messages", structured, thinking,
    )  # fmt: skip
    view = make_view(len(prompt_ids), reading)
    return await respond(ctx, engine_requests, view, bool(req.stream), raw_request, fmt)


def _thinking_budget(
    ctx: ServingContext, req: ChatCompletionRequest, reading: OutputReading
) -> ThinkingBudget | None:
    """The request's cap on its think block; none under an output constraint, whose text
    starts at the output's first token, outside any block."""
    try:
        return thinking_budget(req.thinking_token_budget, reading.reasoning, ctx.tokenizer)
    except ValueError as exc:
        raise bad_request(str(exc), param="thinking_token_budget") from exc


def chat_logprobs(
    strings: TokenStrings, logprobs: list[TokenLogprob], num_top: int, as_ids: bool = False
) -> ChatLogprobs:
    """The chat logprobs object; `as_ids`: tokens written "token_id:<id>" (vLLM's
    return_tokens_as_token_ids), the chosen token's bytes still its own."""
    content = []
    for lp in logprobs:
        top = sorted(lp.top.items(), key=lambda kv: -kv[1])[:num_top]
        content.append(ChatTokenLogprob(
            token=strings.name(lp.token_id, as_ids),
            logprob=clamp_logprob(lp.logprob),
            bytes=strings.bytes(lp.token_id),
            top_logprobs=[_top_logprob(strings, t, v, as_ids) for t, v in top],
        ))  # fmt: skip
    return ChatLogprobs(content=content)


def _top_logprob(
    strings: TokenStrings, token_id: int, logprob: float, as_ids: bool
) -> ChatTopLogprob:
    token = strings.name(token_id, as_ids)
    # vLLM gives a top_logprobs entry the bytes of the string it shows, so "token_id:<id>"'s
    # under return_tokens_as_token_ids; clients written for vLLM read them so.
    raw = list(token.encode()) if as_ids else strings.bytes(token_id)
    return ChatTopLogprob(token=token, logprob=clamp_logprob(logprob), bytes=raw)


class _ChatView:
    """Turns engine outputs into chat responses or stream chunks."""

    def __init__(
        self,
        ctx: ServingContext,
        req: ChatCompletionRequest,
        request_id: str,
        num_prompt: int,
        reading: OutputReading,
    ) -> None:
        self.ctx = ctx
        self.reading = reading
        self.req = req
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt
        self.n = req.num_choices
        self.num_top = req.top_logprobs or 0
        self.as_ids = ctx.tokens_as_ids(req)
        self.created = int(time.time())
        self.model = ctx.served_model_name

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(self.ctx.token_strings, logprobs or [], self.num_top, self.as_ids)

    def _usage(self, finals: dict[str, RequestOutput]) -> UsageInfo:
        completion_tokens = sum(len(o.token_ids) for o in finals.values())
        first = finals.get(f"{self.request_id}-0")
        cached = first.num_cached_tokens if first is not None else 0
        return make_usage(self.num_prompt_tokens, completion_tokens, cached)

    def response(self, finals: dict[str, RequestOutput]) -> ChatCompletionResponse:
        choices = []
        for index in range(self.n):
            out = finals[f"{self.request_id}-{index}"]
            message = self.reading.reader(self.req).message(out.text)
            choices.append(ChatChoice(
                index=index,
                message=message,
                logprobs=self._logprobs(out.logprobs),
                finish_reason=finish_reason(out.finish_reason, bool(message.tool_calls)),
            ))  # fmt: skip
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self._usage(finals),
        )

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        return ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        ).model_dump_json()

    async def chunks(self, stream: EngineStream) -> AsyncIterator[str]:
        for index in range(self.n):
            role = ChatChunkChoice(index=index, delta={"role": "assistant", "content": ""})
            yield self._chunk([role])
        pending: dict[int, list[TokenLogprob]] = defaultdict(list)  # held back with the text
        readers = [self.reading.reader(self.req) for _ in range(self.n)]
        finals: dict[str, RequestOutput] = {}
        async for out in stream:
            index = choice_index(out.request_id)
            pending[index].extend(out.new_logprobs or [])
            reader = readers[index]
            delta = reader.feed(out.new_text)
            if out.finished:
                finals[out.request_id] = out
                delta = merge_deltas(delta, reader.finish())
            if not (delta or out.finished):
                continue  # text held back (a stop string or a tool call may be starting)
            reason = finish_reason(out.finish_reason, reader.made_calls) if out.finished else None
            choice = ChatChunkChoice(
                index=index,
                delta=delta,
                logprobs=self._logprobs(pending.pop(index)),
                finish_reason=reason,
            )
            yield self._chunk([choice])
        if self.req.include_usage:
            yield self._chunk([], usage=self._usage(finals))
