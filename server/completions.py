"""POST /v1/completions: prompts (text or token ids) x n choices, streamed or not.

`echo` prepends the prompt's text. With `echo` and `logprobs`, the prompt's
tokens are listed with null logprobs: the engine does not compute prompt
logprobs (vLLM computes them; this server says "unknown" instead of guessing).
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from engine import RequestOutput, TokenLogprob
from server.engine_client import EngineStream
from server.output_schemas import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    make_usage,
)
from server.protocol import CompletionRequest
from server.serving import (
    ServingContext,
    check_request,
    choice_index,
    clamp_logprob,
    compile_constraint,
    engine_requests_for_prompt,
    respond,
)
from server.structured_outputs import request_constraint
from server.tokens import TokenStrings, encode_prompt
from server.validation import check_completion_supported


async def create_completion(
    ctx: ServingContext, req: CompletionRequest, raw_request: Request
) -> Response:
    prompts = req.prompt_list()
    check_request(ctx, req, "/v1/completions", len(prompts), check_completion_supported)
    constraint = request_constraint(req)
    vocab_size = ctx.engine.vocab_size
    prompt_ids = [encode_prompt(ctx.tokenizer, p, vocab_size, "prompt") for p in prompts]
    echo = (
        [p if isinstance(p, str) else ctx.tokenizer.decode(p) for p in prompts]
        if req.echo
        else None
    )
    request_id = f"cmpl-{uuid.uuid4().hex}"
    structured = await compile_constraint(ctx, constraint)
    engine_requests = [
        r
        for i, ids in enumerate(prompt_ids)
        for r in engine_requests_for_prompt(
            ctx, req, request_id, i, ids, req.max_tokens, req.logprobs, "prompt", structured
        )
    ]
    view = _CompletionView(ctx, req, request_id, prompt_ids, echo)
    return await respond(ctx, engine_requests, view, bool(req.stream), raw_request)


def completion_logprobs(
    strings: TokenStrings,
    logprobs: list[TokenLogprob],
    offset: int,
    echo_prompt: tuple[list[int], str] | None = None,
    as_ids: bool = False,
) -> tuple[CompletionLogProbs, int]:
    """The completions logprobs object, and the text offset after its tokens.

    `echo_prompt` = (prompt ids, prompt text): listed first, with null logprobs.
    `as_ids`: tokens (and top_logprobs' keys) written "token_id:<id>" (vLLM's
    return_tokens_as_token_ids); text_offset still counts the tokens' text, the
    `text` it indexes (vLLM's would count the "token_id:<id>" strings instead).
    """
    out = CompletionLogProbs()
    if echo_prompt is not None:
        ids, text = echo_prompt
        for token_id in ids:
            out.tokens.append(strings.name(token_id, as_ids))
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(strings.text(token_id))
        offset = len(text)  # generated text starts right after the echoed prompt
    for lp in logprobs:
        token = strings.name(lp.token_id, as_ids)
        out.tokens.append(token)
        out.token_logprobs.append(clamp_logprob(lp.logprob))
        # The top N by likelihood, plus the sampled token when it is not among them (vLLM).
        top = sorted(lp.top.items(), key=lambda kv: -kv[1])
        entries = {strings.name(t, as_ids): clamp_logprob(v) for t, v in top}
        entries.setdefault(token, clamp_logprob(lp.logprob))
        out.top_logprobs.append(entries)
        out.text_offset.append(offset)
        offset += len(strings.text(lp.token_id))
    return out, offset


class _CompletionView:
    """Turns engine outputs into completion responses or stream chunks."""

    def __init__(
        self,
        ctx: ServingContext,
        req: CompletionRequest,
        request_id: str,
        prompt_ids: list[list[int]],
        echo: list[str] | None,
    ) -> None:
        self.ctx = ctx
        self.req = req
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.echo = echo
        self.as_ids = ctx.tokens_as_ids(req)
        self.n = req.num_choices
        self.created = int(time.time())
        self.model = ctx.served_model_name

    def _echo_prompt(self, index: int) -> tuple[list[int], str] | None:
        if self.echo is None:
            return None
        p = index // self.n
        return self.prompt_ids[p], self.echo[p]

    def response(self, finals: dict[str, RequestOutput]) -> CompletionResponse:
        choices = []
        for index in range(len(self.prompt_ids) * self.n):
            out = finals[f"{self.request_id}-{index}"]
            echo = self._echo_prompt(index)
            logprobs = None
            if self.req.logprobs is not None:
                logprobs, _ = completion_logprobs(
                    self.ctx.token_strings, out.logprobs or [], 0, echo, self.as_ids
                )
            text = (echo[1] if echo else "") + out.text
            choices.append(CompletionChoice(
                index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason
            ))  # fmt: skip
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self._usage(finals),
        )

    def _usage(self, finals: dict[str, RequestOutput]):
        completion_tokens = sum(len(o.token_ids) for o in finals.values())
        # The prompt counts once however many choices share it; so do its cached tokens.
        cached = sum(
            finals[f"{self.request_id}-{p * self.n}"].num_cached_tokens
            for p in range(len(self.prompt_ids))
        )
        prompt_tokens = sum(len(ids) for ids in self.prompt_ids)
        return make_usage(prompt_tokens, completion_tokens, cached)

    async def chunks(self, stream: EngineStream) -> AsyncIterator[str]:
        offsets: dict[int, int] = defaultdict(int)
        pending: dict[int, list[TokenLogprob]] = defaultdict(list)  # held back with the text
        started: set[int] = set()
        finals: dict[str, RequestOutput] = {}
        async for out in stream:
            index = choice_index(out.request_id)
            pending[index].extend(out.new_logprobs or [])
            if out.finished:
                finals[out.request_id] = out
            echo = self._echo_prompt(index) if index not in started else None
            if not (out.new_text or out.finished or echo):
                continue  # text held back (a stop string may be starting)
            started.add(index)
            logprobs = None
            if self.req.logprobs is not None:
                logprobs, offsets[index] = completion_logprobs(
                    self.ctx.token_strings, pending.pop(index), offsets[index], echo, self.as_ids
                )
            text = (echo[1] if echo else "") + out.new_text
            choice = CompletionChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=out.finish_reason if out.finished else None,
            )
            yield self._chunk([choice]).model_dump_json()
        if self.req.include_usage:
            yield self._chunk([], usage=True, finals=finals).model_dump_json()

    def _chunk(
        self,
        choices: list[CompletionChoice],
        usage: bool = False,
        finals: dict[str, RequestOutput] | None = None,
    ) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self._usage(finals or {}) if usage else None,
        )
