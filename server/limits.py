"""Connection limits: how many sockets, how many requests in flight, how long to send one.

uvicorn bounds none of this by default: a connection that sends a request line and then
one header byte every few seconds (slowloris) is held forever, and `limit_concurrency`
counts those idle sockets with the requests, so it cannot tell the two apart. Here an
HTTP protocol (uvicorn's httptools one plus timers) closes a connection whose headers
are not complete within `header_timeout_s` (counted from the connection's start, or from
the first byte of a later request on a kept-alive one), and one whose body is not
complete within `body_timeout_s` after its headers. Past `max_connections` a new socket
gets a 503 and is closed at once; past `max_concurrent_requests` a request gets a 503 in
the OpenAI shape with `Retry-After`. For the internet, put a reverse proxy in front
(docs/limits.md): it buffers slow clients far more cheaply than Python can.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.errors import OVERLOADED, OpenAIError

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 2048
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0
# File descriptors kept free for everything but client sockets (model files, logs, pipes).
_RESERVED_FDS = 128


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_concurrent_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def uvicorn_config(
    app: Any, limits: ConnectionLimits | None = None, **kwargs: Any
) -> uvicorn.Config:
    """A uvicorn config that serves `app` under `limits` (the one place both the CLI and the
    tests build it, so the tests run the protocol the server runs)."""
    limits = limits or ConnectionLimits()
    return uvicorn.Config(
        app,
        http=protocol_class(limits),
        timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]  # a float works
        **kwargs,
    )


def protocol_class(limits: ConnectionLimits) -> type[LimitedHttpProtocol]:
    """uvicorn builds one protocol per connection from a class: this one carries `limits`."""
    return type("LimitedHttpProtocol", (LimitedHttpProtocol,), {"limits": limits})


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (a default soft limit of 1,024 would let
    one client machine take every socket) and return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # keep what we have; max_connections is clamped to it below
    return soft


def clamp_to_open_files(limits: ConnectionLimits, open_file_limit: int) -> ConnectionLimits:
    """`limits` with `max_connections` lowered to what the open-file limit can hold."""
    most = max(1, open_file_limit - _RESERVED_FDS)
    if limits.max_connections <= most:
        return limits
    logger.warning(
        "--max-connections %d is more than the open-file limit (%d) allows: using %d",
        limits.max_connections, open_file_limit, most,
    )  # fmt: skip
    return ConnectionLimits(**{**limits.__dict__, "max_connections": most})


def too_many_requests(limit: int) -> OpenAIError:
    return OpenAIError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        f"The server has {limit} requests in flight, its limit; retry later.",
        type=OVERLOADED,
        code="too_many_requests_in_flight",
        headers={"Retry-After": "1"},
    )


def _too_many_connections_response() -> bytes:
    body = (
        b'{"error": {"message": "The server has too many open connections; retry later.", '
        b'"type": "overloaded_error", "param": null, "code": "too_many_connections"}}'
    )
    head = (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
    )
    return head + body


_TOO_MANY_CONNECTIONS = _too_many_connections_response()


class _Throttled:
    """Logs a warning at most once per `interval_s`, with how many were left unlogged: under
    a flood, one line per refused socket would fill the disk."""

    def __init__(self, message: str, interval_s: float = 10.0) -> None:
        self.message = message
        self.interval_s = interval_s
        self._last = -float("inf")
        self._skipped = 0

    def warn(self, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._skipped += 1
            return
        logger.warning(self.message + " (%d more since the last such line)", *args, self._skipped)
        self._last, self._skipped = now, 0


_connections_refused = _Throttled("refusing a connection: %d open, the limit")
_requests_refused = _Throttled("refusing a request with 503: %d in flight, the limit")


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for each request's headers and body and
    the two limits. One timer per connection: armed while a request is being received."""

    limits: ConnectionLimits = ConnectionLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._receiving_headers = False
        if len(self.connections) > self.limits.max_connections:
            _connections_refused.warn(self.limits.max_connections)
            transport.write(_TOO_MANY_CONNECTIONS)
            transport.close()
            return
        # A client that connects and sends nothing is held no longer than a slow one.
        self._arm(self.limits.header_timeout_s, headers=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # a later request on a kept-alive connection
            self._arm(self.limits.header_timeout_s, headers=True)

    def on_headers_complete(self) -> None:
        self._arm(self.limits.body_timeout_s, headers=False)
        if len(self.tasks) < self.limits.max_concurrent_requests:
            super().on_headers_complete()
            return
        # uvicorn takes the app for this request from self.app: answer this one with a 503.
        _requests_refused.warn(self.limits.max_concurrent_requests)
        app = self.app
        self.app = too_many_requests(self.limits.max_concurrent_requests).response()
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _arm(self, timeout_s: float, headers: bool) -> None:
        self._disarm()
        self._receiving_headers = headers
        self._deadline = self.loop.call_later(timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        # Closing is the answer: a client this slow would not read a 408 either, and the
        # app (if the body was late) sees a disconnect and gives up the request.
        self._deadline = None
        part = "headers" if self._receiving_headers else "body"
        logger.debug("closing %s: its request %s did not arrive in time", self.client, part)
        if not self.transport.is_closing():
            self.transport.close()
