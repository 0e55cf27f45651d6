"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`, and on
Anthropic's routes (/v1/messages...) in its shape: `{"type": "error", "error": {"type",
"message"}}`.

Every failure the server reports goes through `OpenAIError`, and the handlers
installed by `install_error_handlers` turn FastAPI's own errors (validation,
malformed JSON, unknown routes) into the same shape, so a client never sees
raw pydantic text or a bare 500 for something it sent.
"""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
OVERLOADED = "overloaded_error"


class OpenAIError(Exception):
    """An error the client gets as `{"error": {...}}` with `status_code`."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def anthropic_body(self) -> dict[str, Any]:
        fallback = INVALID_REQUEST if self.status_code < 500 else "api_error"
        kind = _ANTHROPIC_TYPES.get(self.status_code, fallback)
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The error for a request to `path`: in Anthropic's shape on its routes."""
        body = self.anthropic_body() if speaks_anthropic(path) else self.body()
        return JSONResponse(body, status_code=self.status_code, headers=self.headers)

    def sse_event(self) -> str:
        """The error as a server-sent event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body())}\n\n"


# Anthropic's error type for each status its Messages API answers with.
_ANTHROPIC_TYPES = {
    400: INVALID_REQUEST, 401: AUTHENTICATION, 403: "permission_error", 404: NOT_FOUND,
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: OVERLOADED,
}  # fmt: skip
ANTHROPIC_ROUTES = "/v1/messages"


def speaks_anthropic(path: str) -> bool:
    return path == ANTHROPIC_ROUTES or path.startswith(ANTHROPIC_ROUTES + "/")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error response (its schema in /openapi.json)."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """The body of every error response on Anthropic's routes."""

    type: Literal["error"]
    error: AnthropicErrorDetail


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def from_value_error(exc: ValueError, default_param: str | None = None) -> OpenAIError:
    """SamplingParams and the engine raise ValueError("<field> <message>"): keep the field."""
    message = str(exc) or "invalid request"
    first = message.split(" ", 1)[0]
    param = first if first.isidentifier() and first.islower() else default_param
    return bad_request(message, param=param)


def not_found(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(HTTPStatus.NOT_FOUND, message, type=NOT_FOUND, param=param)


def model_not_found(model: str, served: str) -> OpenAIError:
    return OpenAIError(
        HTTPStatus.NOT_FOUND,
        f"The model `{model}` does not exist. This server serves `{served}`.",
        type=NOT_FOUND,
        param="model",
        code="model_not_found",
    )


def unauthorized() -> OpenAIError:
    return OpenAIError(
        HTTPStatus.UNAUTHORIZED,
        "Missing or incorrect API key; send `Authorization: Bearer <key>` or `x-api-key: <key>`.",
        type=AUTHENTICATION,
        code="invalid_api_key",
    )


def body_too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        f"Request body is larger than the limit of {limit} bytes.",
        code="request_too_large",
    )


def overloaded(num_waiting: int, retry_after_s: int = 1) -> OpenAIError:
    return OpenAIError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        f"The server is overloaded ({num_waiting} requests waiting); retry later.",
        type=OVERLOADED,
        code="server_overloaded",
        headers={"Retry-After": str(retry_after_s)},
    )


def queue_timed_out(reason: str, retry_after_s: int = 1) -> OpenAIError:
    """A request that waited past its queue timeout without being scheduled."""
    return OpenAIError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        f"The server is too busy: {reason}; retry later, or allow a longer queue_timeout.",
        type=OVERLOADED,
        code="queue_timeout",
        headers={"Retry-After": str(retry_after_s)},
    )


def grammar_compiler_busy(reason: str, retry_after_s: int = 1) -> OpenAIError:
    """A request whose output constraint could not get to compile in time."""
    return OpenAIError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        f"The server is too busy to compile this request's output constraint ({reason}); "
        "retry later.",
        type=OVERLOADED,
        code="grammar_compiler_busy",
        headers={"Retry-After": str(retry_after_s)},
    )


def engine_dead(reason: str) -> OpenAIError:
    return OpenAIError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        f"The engine is not running: {reason}",
        type=SERVER_ERROR,
        code="engine_dead",
    )


def engine_failed(reason: str) -> OpenAIError:
    """An in-flight request whose engine loop died under it."""
    return OpenAIError(
        HTTPStatus.INTERNAL_SERVER_ERROR,
        f"The engine failed while running this request: {reason}",
        type=SERVER_ERROR,
        code="engine_error",
    )


def shutting_down() -> OpenAIError:
    return OpenAIError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        "The server is shutting down: it takes no new requests, and a request still "
        "running when the drain timeout ends is aborted.",
        type=SERVER_ERROR,
        code="server_shutdown",
    )


# Union members pydantic puts into an error's location: ("body", "prompt", "list[int]", 0).
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _is_type_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part)


def _validation_param(loc: tuple[Any, ...]) -> str | None:
    # loc ("body", "messages", 0, "content") is the OpenAI param "messages.0.content"; a
    # union's member tag ends the path (the client named the field, not the member type).
    parts: list[str] = []
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if _is_type_tag(part):
            break
        parts.append(str(part))
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    if not errors:
        return bad_request("Invalid request body.")
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    param = _validation_param(loc)
    if first.get("type") == "json_invalid":
        return bad_request("Malformed JSON body: " + str(first.get("msg", "")), code="invalid_json")
    if param is None:  # the body itself: not JSON at all, or not an object
        return bad_request("The request body must be a JSON object.", code="invalid_json")
    if first.get("type") == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param)
    same_field = [e for e in errors if _validation_param(tuple(e.get("loc", ()))) == param]
    # A union field has one error per member. A member whose type the value has says what
    # is wrong with it (prompt "" is a string, too short); else list the types it may take.
    value_errors = [e for e in same_field if not str(e.get("type", "")).endswith("_type")]
    union_members = _union_members(same_field)
    if union_members and not value_errors:
        message = f"Invalid value for '{param}': expected one of {', '.join(union_members)}."
    else:
        chosen = (value_errors or [first])[0]
        detail = str(chosen.get("msg", "invalid value")).removeprefix("Value error, ")
        message = f"Invalid value for '{param}': {detail}"
    if len(errors) > len(same_field):
        message += f" (and {len(errors) - len(same_field)} more problem(s))"
    return bad_request(message, param=param)


def _union_members(errors: list[dict[str, Any]]) -> list[str]:
    """The member types of a union field none of which matched, e.g. prompt's four forms."""
    members: list[str] = []
    for error in errors:
        tag = next((str(p) for p in error.get("loc", ()) if _is_type_tag(p)), None)
        # "constrained-str" is pydantic's tag for a str with limits: the client sent a type.
        tag = tag.replace("constrained-", "") if tag is not None else None
        if tag is not None and tag not in members:
            members.append(tag)
    return members if len(members) > 1 else []


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_LOGGED_CHARS = 500


def _one_line(text: str) -> str:
    """Client text made safe for one log line: control characters escaped, length capped."""
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return text if len(text) <= _LOGGED_CHARS else text[:_LOGGED_CHARS] + "..."


def log_client_error(method: str, path: str, error: OpenAIError) -> None:
    """One INFO line for an error that is the client's (a 4xx), never a traceback; a 5xx is
    logged where it happens (a failed engine step with its traceback, `_unexpected`)."""
    if error.status_code < 500:
        logger.info("%s %s -> %d %s: %s", method, _one_line(path), error.status_code,
                    error.code or error.type, _one_line(error.message))  # fmt: skip


def _answer(request: Request, error: OpenAIError) -> JSONResponse:
    log_client_error(request.method, request.url.path, error)
    return error.response(request.url.path)


def _allowed_methods(request: Request) -> list[str]:
    """The methods some route serves at this path (Starlette's 405 names only the first
    route's, and GET and DELETE /v1/responses/{id} are two routes)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return _answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _answer(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
        if exc.status_code == HTTPStatus.NOT_FOUND:
            kind = NOT_FOUND
        headers = exc.headers
        if exc.status_code == HTTPStatus.METHOD_NOT_ALLOWED:  # every route of the path's
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
        err = OpenAIError(exc.status_code, str(exc.detail), type=kind, headers=headers)
        return _answer(request, err)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, never a user error: log the traceback, tell the client nothing internal.
        logger.exception("unhandled error: %s", exc)
        err = OpenAIError(
            HTTPStatus.INTERNAL_SERVER_ERROR, "Internal server error.", type=SERVER_ERROR
        )
        return err.response(request.url.path)
