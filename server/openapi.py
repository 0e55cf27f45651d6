"""/openapi.json as the server behaves, so generated clients and fuzzers can trust it.

FastAPI's defaults describe a different server: 422 validation errors (this one sends
400 in the OpenAI shape, as OpenAI's clients expect), and JSON from every route. Routes
declare their real responses with `responses(...)`; `install_openapi` drops the 422s and
fills in the limits only the running server knows (vocabulary, context length, served
model name, sequences per request), which the request models mark with `LIMIT_KEY`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from server.errors import ErrorResponse
from server.protocol import MAX_N
from server.request_base import LIMIT_KEY
from server.serving import ServingContext

_ERROR_DESCRIPTIONS = {
    400: "Invalid request: the error's `param` names the field.",
    401: "Missing or wrong API key (only when the server runs with --api-key).",
    404: "No such model (this server serves one) or route.",
    413: "Request body larger than --max-request-body-bytes.",
    500: "The engine failed while running the request.",
    501: "Not available on this server (the dashboard of a data-parallel ingress).",
    503: "Overloaded (see Retry-After), shutting down, or the engine is not running.",
}
# Streams are server-sent events: `data: <a JSON chunk>` events, then `data: [DONE]`.
SSE = {
    "text/event-stream": {
        "schema": {
            "description": "One server-sent event.",
            "type": "object",
            "required": ["data"],
            "properties": {"data": {"type": "string"}},
        }
    }
}


# Anthropic's and the Responses API's streams: `event: <type>` and `data: <its JSON>` per
# event, no [DONE].
ANTHROPIC_SSE = RESPONSES_SSE = {
    "text/event-stream": {
        "schema": {
            "description": "One server-sent event.",
            "type": "object",
            "required": ["event", "data"],
            "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
        }
    }
}


def responses(
    ok: type[BaseModel] | None,
    *errors: int,
    ok_content: dict[str, Any] | None = None,
    error_model: type[BaseModel] = ErrorResponse,
) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=`: its 200 body model, extra 200 media types, its errors."""
    documented: dict[int | str, dict[str, Any]] = {
        status: {"model": error_model, "description": _ERROR_DESCRIPTIONS[status]}
        for status in errors
    }
    if ok is not None or ok_content is not None:
        success: dict[str, Any] = {"description": "Successful Response"}
        if ok is not None:
            success["model"] = ok
        if ok_content is not None:
            success["content"] = ok_content
        documented[200] = success
    return documented


def install_openapi(
    app: FastAPI, ctx: ServingContext, model_names: list[str] | None = None
) -> None:
    """`model_names`: the models a request may name (default: the one `ctx` serves)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, routes=app.routes,
                description=app.description,
            )  # fmt: skip
            _drop_validation_errors(schema)
            _fill_limits(schema, _limits(ctx, model_names or [ctx.served_model_name]))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _drop_validation_errors(schema: dict[str, Any]) -> None:
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)


def _limits(ctx: ServingContext, model_names: list[str]) -> dict[str, dict[str, Any]]:
    vocab_size = ctx.engine.vocab_size
    # A prompt leaves room for at least one generated token.
    max_prompt_tokens = ctx.engine.max_model_len - 1
    return {
        "token_id": {"maximum": vocab_size - 1},
        "token_id_key": {"pattern": token_id_key_pattern(vocab_size)},
        "prompt_tokens": {"maxItems": max_prompt_tokens},
        "max_tokens": {"maximum": max_prompt_tokens},
        "prompts": {"maxItems": ctx.max_seqs_per_request},
        "n": {"maximum": min(MAX_N, ctx.max_seqs_per_request)},
        "model": {"enum": [*model_names, None]},
        "model_id": {"enum": model_names},
    }


def _fill_limits(node: Any, limits: dict[str, dict[str, Any]]) -> None:
    if isinstance(node, dict):
        name = node.pop(LIMIT_KEY, None)
        if name is not None:
            node.update(limits[name])
        for value in node.values():
            _fill_limits(value, limits)
    elif isinstance(node, list):
        for value in node:
            _fill_limits(value, limits)


def token_id_key_pattern(vocab_size: int) -> str:
    """A regex for the object keys validation.TOKEN_ID_KEY reads as ids in [0, vocab_size)."""
    return f"^(?:-?0+|0*(?:{_decimals_up_to(vocab_size - 1)}))$"


def _decimals_up_to(top: int) -> str:
    """A regex for the decimal numbers 1..top (top >= 1) without leading zeros."""
    digits = str(top)
    n = len(digits)
    alternatives = [f"[1-9][0-9]{{0,{n - 2}}}"] if n > 1 else []  # fewer digits than top
    for i, digit in enumerate(digits):
        low = 1 if i == 0 else 0
        if int(digit) > low:  # same prefix as top, a smaller digit here, anything after
            alternatives.append(f"{digits[:i]}[{low}-{int(digit) - 1}][0-9]{{{n - i - 1}}}")
    alternatives.append(digits)
    return "|".join(alternatives)
