"""What the completions and chat endpoints share: admission, submission, collection, SSE.

A request's engine requests are submitted together (ids `<id>-<choice index>`,
choice index = prompt index * n + i). Non-streaming handlers collect final
outputs while watching for the client to disconnect; streaming handlers wrap
their chunks in `sse_events`. Either way, leaving (disconnect, cancellation,
error) aborts whatever has not finished, so its KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from engine import RequestOutput, SamplingParams, StructuredOutputs, ThinkingBudget
from engine.template_bounds import DEFAULT_TIMEOUT_S
from server.chat_renderer import ChatRenderer
from server.engine_client import (
    EngineClient,
    EngineDeadError,
    EngineError,
    EngineRequest,
    EngineShutdownError,
    EngineStream,
    QueueTimeoutError,
)
from server.errors import (
    OpenAIError,
    bad_request,
    engine_dead,
    engine_failed,
    from_value_error,
    grammar_compiler_busy,
    model_not_found,
    overloaded,
    queue_timed_out,
    shutting_down,
)
from server.grammar_compiler import CompilerBusy, CompileTimedOut
from server.protocol import OpenAIBaseModel, SamplingFields
from server.response_store import ResponseStore
from server.sampling_params import to_sampling_params
from server.tokens import TokenStrings
from server.validation import check_common, check_context_length

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's code; the client never sees it
# Sequences (prompts x n) one request may ask for: 1000 prompts x n=128 in an 8 KB body
# would otherwise queue 128,000 sequences and stall the server building them.
DEFAULT_MAX_SEQS_PER_REQUEST = 256
# Seconds a grammar may take to compile, and may wait to start (server/grammar_compiler.py):
# the largest schemas compile in ~0.1 s, hostile 300,000-character regexes in seconds; so a
# request waits at most twice this for its constraint, well inside a client's timeout.
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 30.0


@dataclass
class ServingContext:
    engine: EngineClient
    served_model_name: str
    max_waiting_requests: int | None = None
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST
    queue_timeout: float | None = None  # seconds; a request's own queue_timeout wins
    grammar_compile_timeout: float | None = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S  # None: no limit
    reasoning_parser: str = "auto"  # server/reasoning.py's REASONING_PARSERS
    tool_call_parser: str = "auto"  # server/tool_formats.py's TOOL_PARSERS
    return_tokens_as_token_ids: bool = False  # a request's own field wins
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses' store
    chat_template_timeout: float = DEFAULT_TIMEOUT_S  # seconds one render may take
    token_strings: TokenStrings = field(init=False)
    chat_renderer: ChatRenderer = field(init=False)  # this model's, on threads of its own

    def __post_init__(self) -> None:
        self.token_strings = TokenStrings(self.engine.tokenizer)
        self.chat_renderer = ChatRenderer(self.engine.tokenizer, self.engine.max_model_len,
                                          self.chat_template_timeout, self.served_model_name)  # fmt: skip

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def tokens_as_ids(self, req: SamplingFields) -> bool:
        """Whether `req`'s logprobs name tokens by id ("token_id:<id>"): its own
        `return_tokens_as_token_ids` where set, false included, else the server's (vLLM's)."""
        own = req.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if own is None else own

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise model_not_found(model, self.served_model_name)


class ResponseView(Protocol):
    """An endpoint's rendering of engine outputs: a whole response, or stream chunks."""

    def response(self, finals: dict[str, RequestOutput]) -> BaseModel: ...

    def chunks(self, stream: EngineStream) -> AsyncIterator[str]: ...


def warn_unknown_fields(req: OpenAIBaseModel, endpoint: str) -> None:
    unknown = req.unknown_fields()
    if unknown:
        logger.warning("%s: ignoring unknown field(s) %s", endpoint, ", ".join(unknown))


def check_request(
    ctx: ServingContext,
    req: Any,
    endpoint: str,
    num_prompts: int,
    check_supported: Callable[[Any], None],
) -> None:
    """What every generation request is checked for before its prompt is read;
    `check_supported`: the endpoint's refusal of the fields it cannot honour."""
    ctx.check_model(req.model)
    check_fan_out(ctx, num_prompts, req.num_choices)
    check_supported(req)
    warn_unknown_fields(req, endpoint)
    check_common(req, ctx.engine.vocab_size, ctx.engine.max_model_len)


def check_fan_out(ctx: ServingContext, num_prompts: int, n: int) -> None:
    """400 for a request of more sequences (prompts x n) than --max-seqs-per-request."""
    limit = ctx.max_seqs_per_request
    if num_prompts * n > limit:
        raise bad_request(
            f"This request asks for {num_prompts * n} sequences ({num_prompts} prompt(s) x "
            f"n={n}); the server allows at most {limit} per request "
            "(--max-seqs-per-request). Send fewer prompts or a smaller n.",
            param="n" if n > 1 else "prompt",
            code="too_many_sequences",
        )


def choice_index(request_id: str) -> int:
    """The choice index an engine request id (`<id>-<index>`) ends with."""
    return int(request_id.rsplit("-", 1)[1])


async def respond(
    ctx: ServingContext,
    requests: list[EngineRequest],
    view: ResponseView,
    streaming: bool,
    raw_request: Request,
    fmt: StreamFormat | None = None,
) -> Response:
    """Submit the requests, then stream the view's chunks (framed as `fmt` says, OpenAI's
    `data:` events by default) or return its whole response."""
    stream = await submit(ctx, requests)
    if streaming:
        return StreamingResponse(
            sse_events(stream, view.chunks(stream), fmt or OPENAI_STREAM),
            media_type="text/event-stream",
            background=BackgroundTask(stream.abort),  # also when the body never started
        )
    finals = await collect_final(stream, raw_request)
    return Response(view.response(finals).model_dump_json(), media_type="application/json")


async def submit(ctx: ServingContext, requests: list[EngineRequest]) -> EngineStream:
    """Admission control, then hand the requests to the engine; errors in the OpenAI shape."""
    limit = ctx.max_waiting_requests
    if limit is not None and ctx.engine.num_waiting >= limit:
        raise overloaded(ctx.engine.num_waiting)
    try:
        return await ctx.engine.submit(requests)
    except ValueError as exc:
        raise from_value_error(exc, default_param="prompt") from exc
    except EngineShutdownError as exc:
        raise shutting_down() from exc
    except EngineDeadError as exc:
        raise engine_dead(str(exc)) from exc


def in_flight_error(exc: EngineError) -> OpenAIError:
    """The error for a request the engine stopped serving midway (a failed step, a dead
    engine: 500 engine_error; a shutdown or a queue timeout: 503)."""
    if isinstance(exc, QueueTimeoutError):
        return queue_timed_out(str(exc))
    return shutting_down() if isinstance(exc, EngineShutdownError) else engine_failed(str(exc))


async def _final_outputs(stream: EngineStream) -> dict[str, RequestOutput]:
    final: dict[str, RequestOutput] = {}
    async for out in stream:
        final[out.request_id] = out
    return final


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read already, so the next ASGI message is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_final(stream: EngineStream, raw_request: Request) -> dict[str, RequestOutput]:
    """Every request's final output; aborts them all if the client disconnects first."""
    collector = asyncio.ensure_future(_final_outputs(stream))
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        done, _ = await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if collector in done:
            return collector.result()
        raise OpenAIError(CLIENT_CLOSED_REQUEST, "client disconnected")
    except EngineError as exc:
        raise in_flight_error(exc) from exc
    finally:
        watcher.cancel()
        collector.cancel()
        stream.abort()


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def named_event(name: str, payload: dict[str, Any]) -> str:
    """A server-sent event that names its type: `event: <name>`, then its JSON (the form
    of Anthropic's and of the Responses API's streams)."""
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def as_is(chunk: str) -> str:
    return chunk


@dataclass(frozen=True)
class StreamFormat:
    """How a stream is written: each chunk a view yields, the error that stops a stream
    that has started (its status is sent: the error goes in-band), and the last event."""

    frame: Callable[[str], str]
    error: Callable[[OpenAIError], str]
    done: str = ""


OPENAI_STREAM = StreamFormat(sse, OpenAIError.sse_event, SSE_DONE)  # data: {...}, data: [DONE]


async def sse_events(
    stream: EngineStream, chunks: AsyncIterator[str], fmt: StreamFormat = OPENAI_STREAM
) -> AsyncIterator[str]:
    """The view's chunks as `fmt` frames them, an error event if the engine fails, then
    `fmt.done`.

    A disconnect cancels this generator at an await or a yield: `finally` aborts.
    """
    try:
        try:
            async for chunk in chunks:
                yield fmt.frame(chunk)
        except EngineError as exc:
            yield fmt.error(in_flight_error(exc))
        except OpenAIError as exc:
            yield fmt.error(exc)
        except Exception as exc:  # a bug: tell the client in-band, keep the details in the log
            logger.exception("stream failed: %s", exc)
            yield fmt.error(OpenAIError(500, "Internal server error.", type="server_error"))
        if fmt.done:
            yield fmt.done
    finally:
        stream.abort()


def clamp_logprob(value: float) -> float:
    # JSON has no -inf; vLLM reports impossible tokens as -9999.0.
    return max(value, -9999.0)


async def compile_constraint(
    ctx: ServingContext, constraint: tuple[StructuredOutputs, str] | None
) -> StructuredOutputs | None:
    """Compile the request's output constraint off the engine thread; 400 naming the field
    when it cannot be compiled (with the compiler's message) or its compile runs past
    --grammar-compile-timeout, 503 + Retry-After when the compile could not get to run."""
    if constraint is None:
        return None
    spec, param = constraint
    try:
        await ctx.engine.compile_grammar(spec, ctx.grammar_compile_timeout)
    except CompileTimedOut as exc:
        raise bad_request(
            f"Invalid `{param}`: it {exc} (--grammar-compile-timeout); a simpler schema, "
            "grammar or pattern compiles faster.",
            param=param,
            code="grammar_compile_timeout",
        ) from exc
    except CompilerBusy as exc:
        raise grammar_compiler_busy(str(exc)) from exc
    except ValueError as exc:
        raise bad_request(f"Invalid `{param}`: {exc}", param=param) from exc
    return spec


def sampling_params(
    req: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    choice: int,
    vocab_size: int,
    structured: StructuredOutputs | None = None,
    thinking: ThinkingBudget | None = None,
) -> SamplingParams:
    try:
        return to_sampling_params(req, max_tokens, logprobs, choice, vocab_size, structured,
                                  thinking)  # fmt: skip
    except ValueError as exc:
        raise from_value_error(exc) from exc


def engine_requests_for_prompt(
    ctx: ServingContext,
    req: SamplingFields,
    request_id: str,
    prompt_index: int,
    prompt_ids: list[int],
    max_tokens: int | None,
    logprobs: int | None,
    prompt_param: str,
    structured: StructuredOutputs | None = None,
    thinking: ThinkingBudget | None = None,
) -> list[EngineRequest]:
    """The n engine requests of one prompt (ids `<id>-<prompt_index * n + i>`).

    The n sequences share the prompt's KV blocks through the prefix cache; with a
    seed, sequence i draws with seed + i so the choices differ.
    """
    max_model_len = ctx.engine.max_model_len
    if max_tokens is None:  # as much as the context leaves (vLLM's default)
        max_tokens = max(max_model_len - len(prompt_ids), 1)
    n = req.num_choices
    requests = [
        EngineRequest(
            f"{request_id}-{prompt_index * n + i}",
            prompt_ids,
            sampling_params(
                req, max_tokens, logprobs, i, ctx.engine.vocab_size, structured, thinking
            ),
            req.cache_salt,
            req.priority,
            req.queue_timeout if req.queue_timeout is not None else ctx.queue_timeout,
        )
        for i in range(n)
    ]
    check_context_length(len(prompt_ids), max_tokens, max_model_len, prompt_param)
    return requests
