"""The FastAPI app: OpenAI routes plus vLLM's health, metrics and tokenizer routes.

`build_app` wires an `EngineClient` (server/engine_client.py: the in-process
`AsyncEngine`, or the replicas' `RemoteEngine`) into the routes; the app's lifespan
starts it and, at shutdown, stops it, aborting whatever is still in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import replace
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute

from engine.template_bounds import DEFAULT_TIMEOUT_S
from server.chat import create_chat_completion
from server.chat_rendering import plain_message
from server.completions import create_completion
from server.dashboard import PAGE_PATH, add_dashboard_routes
from server.engine_client import EngineClient, EngineDeadError
from server.errors import (
    AnthropicErrorResponse,
    engine_dead,
    install_error_handlers,
    shutting_down,
)
from server.json_body import read_json_body
from server.messages import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    count_tokens,
    create_message,
)
from server.middleware import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
)
from server.model_router import ModelRouter
from server.model_routes import add_model_routes, model_list
from server.model_routes import model_card as model_card_of
from server.openapi import ANTHROPIC_SSE, RESPONSES_SSE, SSE, install_openapi, responses
from server.output_schemas import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ResetPrefixCacheResponse,
    TokenizeResponse,
)
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from server.reasoning import REASONING_PARSERS
from server.request_base import server_limit
from server.responses import (
    DeletedResponse,
    ResponseObject,
    ResponsesRequest,
    create_response,
    delete_response,
    get_response,
)
from server.serving import (
    DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_SEQS_PER_REQUEST,
    ServingContext,
    warn_unknown_fields,
)
from server.tool_formats import TOOL_PARSERS
from server.validation import check_token_ids, check_tokenize_input

# The dashboard's page holds no data; its JSON (/dashboard/state) needs the key.
OPEN_PATHS = frozenset({"/health", "/metrics", PAGE_PATH})


def build_app(
    engine_client: EngineClient,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_waiting_requests: int | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST,
    queue_timeout: float | None = None,
    grammar_compile_timeout: float | None = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
    reasoning_parser: str = "auto",
    tool_call_parser: str = "auto",
    return_tokens_as_token_ids: bool = False,
    models: ModelRouter | None = None,
    chat_template_timeout: float = DEFAULT_TIMEOUT_S,
) -> FastAPI:
    """The HTTP app over a started-on-demand engine bridge.

    `served_model_name` defaults to the engine's model name; `api_key` guards every
    route but /health, /metrics and the /dashboard page (not its state);
    `max_waiting_requests` turns requests away with 503 + Retry-After while that many
    engine requests wait to be scheduled;
    `max_seqs_per_request` caps prompts x n of one request (400 beyond it);
    `queue_timeout` is the seconds a request may wait unscheduled unless it sets its own
    (then 503 `queue_timeout`);
    `grammar_compile_timeout` the seconds an output constraint may take to compile (then
    400 `grammar_compile_timeout`) and may wait to start (then 503; None: no limit);
    `reasoning_parser` how a think block is separated from the answer (server/reasoning.py);
    `tool_call_parser` the tool-call format read under tool_choice "auto"
    (server/tool_formats.py);
    `return_tokens_as_token_ids` whether logprobs write tokens as "token_id:<id>" for the
    requests that do not say (vLLM's flag);
    `models` several models (server/model_router.py), each request served by the one it
    names, `engine_client` then being their server/router_engine.py;
    `chat_template_timeout` the seconds one render of a chat template may take (the
    engine's `--chat-template-timeout`, which checked the template at load).
    """
    if max_waiting_requests is not None and max_waiting_requests < 1:
        raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
    if max_seqs_per_request < 1:
        raise ValueError(f"max_seqs_per_request must be >= 1, got {max_seqs_per_request}")
    if reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}")
    if tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {TOOL_PARSERS}")
    seconds = {"queue_timeout": queue_timeout, "grammar_compile_timeout": grammar_compile_timeout,
               "chat_template_timeout": chat_template_timeout}  # fmt: skip
    for name, value in seconds.items():
        if value is not None and not 0 < value < float("inf"):
            raise ValueError(f"{name} must be a number of seconds > 0, got {value}")
    ctx = ServingContext(
        engine=engine_client,
        served_model_name=served_model_name or engine_client.model_name,
        max_waiting_requests=max_waiting_requests,
        max_seqs_per_request=max_seqs_per_request,
        queue_timeout=queue_timeout,
        grammar_compile_timeout=grammar_compile_timeout,
        reasoning_parser=reasoning_parser,
        tool_call_parser=tool_call_parser,
        return_tokens_as_token_ids=return_tokens_as_token_ids,
        chat_template_timeout=chat_template_timeout,
    )
    use = _one_model(ctx) if models is None else models.use
    if models is not None:  # each model served with these options over its own engine
        models.bind(lambda engine, name: replace(ctx, engine=engine, served_model_name=name))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine_client.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine_client.shutdown)

    app = FastAPI(title="pagedserve", lifespan=lifespan)
    app.router.route_class = JsonBodyRoute  # before any route is added
    app.state.ctx = ctx
    install_error_handlers(app)
    install_openapi(app, ctx, models.registry.names if models is not None else None)
    _add_openai_routes(app, ctx, use, models)
    _add_server_routes(app, ctx, use, models)
    add_dashboard_routes(app, ctx, models.loaded_context if models is not None else None)
    if models is not None:
        add_model_routes(app, models)
    # The last added middleware runs first: refuse a bad key before reading any body.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=OPEN_PATHS)
    return app


# The ServingContext of the model a request names (None: the default), held while the
# request is handed to it.
UseModel = Callable[[str | None], AbstractAsyncContextManager[ServingContext]]


def _one_model(ctx: ServingContext) -> UseModel:
    """A single-model server's `use`: its one context (the handlers check the name)."""

    @asynccontextmanager
    async def use(_: str | None) -> AsyncIterator[ServingContext]:
        yield ctx

    return use


class JsonBodyRequest(Request):
    """A request whose JSON body is read by `read_json_body` (FastAPI calls `json()`)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json_body"):
            self._json_body = read_json_body(await self.body())
        return self._json_body


class JsonBodyRoute(APIRoute):
    """Every route reads its body through the one bounded reader, before FastAPI does.

    Read first so that its 400s (too deep, not JSON, not Unicode) reach the error handlers
    as they are: raised inside FastAPI's own body reading they would become a bare 400.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        takes_body = self.body_field is not None  # a GET's body is ignored, as FastAPI does

        async def read_then_handle(request: Request) -> Response:
            request = JsonBodyRequest(request.scope, request.receive)
            declared = _declares_json(request.headers.get("content-type"))
            if takes_body and declared and await request.body():
                await request.json()
            return await handler(request)

        return read_then_handle


def _declares_json(content_type: str | None) -> bool:
    """Whether FastAPI parses a body of this type as JSON (application/json or */*+json)."""
    mime = (content_type or "").split(";", 1)[0].strip().lower()
    return mime == "application/json" or (
        mime.startswith("application/") and mime.endswith("+json")
    )


_GENERATION_ERRORS = (400, 401, 404, 413, 500, 503)


def _add_openai_routes(
    app: FastAPI, ctx: ServingContext, use: UseModel, models: ModelRouter | None
) -> None:
    @app.post(
        "/v1/completions",
        responses=responses(CompletionResponse, *_GENERATION_ERRORS, ok_content=SSE),
    )
    async def completions(body: CompletionRequest, raw_request: Request) -> Response:
        async with use(body.model) as model_ctx:
            return await create_completion(model_ctx, body, raw_request)

    @app.post(
        "/v1/chat/completions",
        responses=responses(ChatCompletionResponse, *_GENERATION_ERRORS, ok_content=SSE),
    )
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request) -> Response:
        async with use(body.model) as model_ctx:
            return await create_chat_completion(model_ctx, body, raw_request)

    # Anthropic's Messages API: the chat route's request in Anthropic's shapes.
    @app.post(
        "/v1/messages",
        responses=responses(MessageResponse, *_GENERATION_ERRORS, ok_content=ANTHROPIC_SSE,
                            error_model=AnthropicErrorResponse),
    )  # fmt: skip
    async def messages(body: MessagesRequest, raw_request: Request) -> Response:
        async with use(body.model) as model_ctx:
            return await create_message(model_ctx, body, raw_request)

    @app.post(
        "/v1/messages/count_tokens",
        responses=responses(CountTokensResponse, 400, 401, 404, 413,
                            error_model=AnthropicErrorResponse),
    )  # fmt: skip
    async def messages_count_tokens(body: CountTokensRequest) -> Response:
        async with use(body.model) as model_ctx:
            return JSONResponse((await count_tokens(model_ctx, body)).model_dump())

    # OpenAI's Responses API: the chat route's request in its shapes, and its stored answers.
    @app.post(
        "/v1/responses",
        responses=responses(ResponseObject, *_GENERATION_ERRORS, ok_content=RESPONSES_SSE),
    )
    async def create_responses(body: ResponsesRequest, raw_request: Request) -> Response:
        async with use(body.model) as model_ctx:
            return await create_response(model_ctx, body, raw_request)

    @app.get("/v1/responses/{response_id}", responses=responses(ResponseObject, 401, 404))
    async def read_response(response_id: str) -> Response:
        return JSONResponse(get_response(ctx, response_id))

    @app.delete("/v1/responses/{response_id}", responses=responses(DeletedResponse, 401, 404))
    async def remove_response(response_id: str) -> Response:
        return JSONResponse(delete_response(ctx, response_id).model_dump())

    def model_card() -> ModelCard:
        return ModelCard(
            id=ctx.served_model_name,
            root=ctx.engine.model_name,
            max_model_len=ctx.engine.max_model_len,
        )

    @app.get("/v1/models", responses=responses(ModelList, 401))
    async def list_models() -> Response:
        if models is not None:
            return JSONResponse(model_list(models).model_dump())
        return JSONResponse(ModelList(data=[model_card()]).model_dump())

    # `:path`: a served name may hold a slash ("org/model"), as Hugging Face ids do.
    @app.get("/v1/models/{model:path}", responses=responses(ModelCard, 401, 404))
    async def model(
        model: Annotated[str, PathParam(json_schema_extra=server_limit("model_id"))],
    ) -> Response:
        if models is not None:
            card = model_card_of(models, models.registry.find(model))
            return JSONResponse(card.model_dump())
        ctx.check_model(model)
        return JSONResponse(model_card().model_dump())


def _add_server_routes(
    app: FastAPI, ctx: ServingContext, use: UseModel, models: ModelRouter | None
) -> None:
    @app.get("/health", response_class=Response, responses=responses(None, 503))
    async def health() -> Response:
        if not ctx.engine.is_alive:
            return engine_dead(ctx.engine.dead_reason or "not started").response()
        if not ctx.engine.is_accepting:  # draining: tell load balancers to stop sending
            return shutting_down().response()
        return Response(status_code=200)

    @app.get("/metrics", response_class=PlainTextResponse)  # the Prometheus text format
    async def metrics() -> Response:
        body, content_type = ctx.engine.metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/tokenize", responses=responses(TokenizeResponse, 400, 401, 404, 413))
    async def tokenize(body: TokenizeRequest) -> Response:
        async with use(body.model) as model_ctx:
            return await _tokenize(model_ctx, body)

    @app.post("/detokenize", responses=responses(DetokenizeResponse, 400, 401, 404, 413))
    async def detokenize(body: DetokenizeRequest) -> Response:
        async with use(body.model) as model_ctx:
            model_ctx.check_model(body.model)
            check_token_ids(body.tokens, model_ctx.engine.vocab_size, "tokens")
            text = model_ctx.tokenizer.decode(body.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    @app.post("/reset_prefix_cache", responses=responses(ResetPrefixCacheResponse, 401, 503))
    async def reset_prefix_cache() -> Response:
        # Several models: every loaded model's cache (each refuses while it is busy).
        engines = [e.client for e in models.loaded()] if models is not None else [ctx.engine]
        try:
            ok = [await engine.call(lambda core: core.reset_prefix_cache()) for engine in engines]
        except EngineDeadError as exc:
            raise engine_dead(str(exc)) from exc
        return JSONResponse(ResetPrefixCacheResponse(success=all(ok)).model_dump())


async def _tokenize(ctx: ServingContext, body: TokenizeRequest) -> Response:
    ctx.check_model(body.model)
    check_tokenize_input(body)
    warn_unknown_fields(body, "/tokenize")
    tokenizer = ctx.tokenizer
    if body.messages is not None:
        # The chat endpoint's message rules (roles, text-only parts) apply here too.
        conversation = [plain_message(i, m) for i, m in enumerate(body.messages)]
        text = await ctx.chat_renderer.render(conversation,
                                              body.add_generation_prompt is not False,
                                              template_kwargs=body.chat_template_kwargs)  # fmt: skip
        tokens = list(tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens)))
    else:
        add_special = body.add_special_tokens is not False
        tokens = list(tokenizer.encode(body.prompt, add_special_tokens=add_special))
    strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    out = TokenizeResponse(
        count=len(tokens), max_model_len=ctx.engine.max_model_len, tokens=tokens,
        token_strs=strs,
    )  # fmt: skip
    return JSONResponse(out.model_dump())
