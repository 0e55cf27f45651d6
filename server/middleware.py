"""Pure ASGI middleware: API-key check and request-body size limit.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect
detection pass through untouched.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import OpenAIError, body_too_large, log_client_error, unauthorized

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024


class ApiKeyMiddleware:
    """The API key on every HTTP path except the open ones.

    Sent as `Authorization: Bearer <key>` (OpenAI's SDKs; the scheme in any case, as RFC
    9110 section 11.1 has it) or `x-api-key: <key>` (Anthropic's SDK). Compared in constant
    time, each header that is present.
    """

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self._expected = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        if not self._authorized(dict(scope["headers"])):
            await _refuse(unauthorized(), scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        given = [_bearer_token(headers.get(b"authorization")), headers.get(b"x-api-key")]
        matches = [hmac.compare_digest(key, self._expected) for key in given if key is not None]
        return any(matches)


def _bearer_token(value: bytes | None) -> bytes | None:
    """The credentials of `Bearer <token>`, the scheme in any case; None for another scheme."""
    if value is None:
        return None
    scheme, _, token = value.partition(b" ")
    return token.strip(b" ") if scheme.lower() == b"bearer" else None


async def _refuse(error: OpenAIError, scope: Scope, receive: Receive, send: Send) -> None:
    log_client_error(scope["method"], scope["path"], error)
    await error.response(scope["path"])(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for a body over `max_bytes`: by Content-Length, and by the bytes actually sent.

    The body is read here (the app buffers it anyway) and replayed as one message;
    later receive() calls go to the server, so disconnects are still seen.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _refuse(body_too_large(self.max_bytes), scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body: nothing to answer
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await _refuse(body_too_large(self.max_bytes), scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
