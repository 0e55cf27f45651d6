"""POST /v1/chat/completions: messages through the model's chat template, n choices.

Streaming sends, per choice, a first chunk with `delta: {"role": "assistant",
"content": ""}`, then content deltas, and a last chunk carrying its
`finish_reason`; then the usage chunk if asked, then `[DONE]`.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from engine import RequestOutput, TokenLogprob
from server.async_engine import RequestStream
from server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    UsageInfo,
    make_usage,
)
from server.serving import (
    ServingContext,
    check_request,
    choice_index,
    clamp_logprob,
    engine_requests_for_prompt,
    respond,
)
from server.tokens import TokenStrings, apply_chat_template, encode_chat


async def create_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, raw_request: Request
) -> Response:
    check_request(ctx, req, "/v1/chat/completions", num_prompts=1)
    text = apply_chat_template(
        ctx.tokenizer, req.conversation(), req.add_generation_prompt is not False
    )
    prompt_ids = encode_chat(ctx.tokenizer, text)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    engine_requests = engine_requests_for_prompt(
        ctx, req, request_id, 0, prompt_ids, req.requested_max_tokens(), req.num_logprobs(),
        "messages",
    )  # fmt: skip
    view = _ChatView(ctx, req, request_id, len(prompt_ids))
    return await respond(ctx, engine_requests, view, bool(req.stream), raw_request)


def chat_logprobs(
    strings: TokenStrings, logprobs: list[TokenLogprob], num_top: int
) -> ChatLogprobs:
    content = []
    for lp in logprobs:
        top = sorted(lp.top.items(), key=lambda kv: -kv[1])[:num_top]
        content.append(ChatTokenLogprob(
            token=strings.text(lp.token_id),
            logprob=clamp_logprob(lp.logprob),
            bytes=strings.bytes(lp.token_id),
            top_logprobs=[
                ChatTopLogprob(token=strings.text(t), logprob=clamp_logprob(v), bytes=strings.bytes(t))
                for t, v in top
            ],
        ))  # fmt: skip
    return ChatLogprobs(content=content)


class _ChatView:
    """Turns engine outputs into chat responses or stream chunks."""

    def __init__(
        self, ctx: ServingContext, req: ChatCompletionRequest, request_id: str, num_prompt: int
    ) -> None:
        self.ctx = ctx
        self.req = req
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt
        self.n = req.num_choices
        self.num_top = req.top_logprobs or 0
        self.created = int(time.time())
        self.model = ctx.served_model_name

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(self.ctx.token_strings, logprobs or [], self.num_top)

    def _usage(self, finals: dict[str, RequestOutput]) -> UsageInfo:
        completion_tokens = sum(len(o.token_ids) for o in finals.values())
        first = finals.get(f"{self.request_id}-0")
        cached = first.num_cached_tokens if first is not None else 0
        return make_usage(self.num_prompt_tokens, completion_tokens, cached)

    def response(self, finals: dict[str, RequestOutput]) -> ChatCompletionResponse:
        choices = []
        for index in range(self.n):
            out = finals[f"{self.request_id}-{index}"]
            choices.append(ChatChoice(
                index=index,
                message=ChatMessage(content=out.text),
                logprobs=self._logprobs(out.logprobs),
                finish_reason=out.finish_reason,
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

    async def chunks(self, stream: RequestStream) -> AsyncIterator[str]:
        for index in range(self.n):
            role = ChatChunkChoice(index=index, delta={"role": "assistant", "content": ""})
            yield self._chunk([role])
        pending: dict[int, list[TokenLogprob]] = defaultdict(list)  # held back with the text
        finals: dict[str, RequestOutput] = {}
        async for out in stream:
            index = choice_index(out.request_id)
            pending[index].extend(out.new_logprobs or [])
            if out.finished:
                finals[out.request_id] = out
            if not (out.new_text or out.finished):
                continue  # text held back (a stop string may be starting)
            choice = ChatChunkChoice(
                index=index,
                delta={"content": out.new_text} if out.new_text else {},
                logprobs=self._logprobs(pending.pop(index)),
                finish_reason=out.finish_reason if out.finished else None,
            )
            yield self._chunk([choice])
        if self.req.include_usage:
            yield self._chunk([], usage=self._usage(finals))
