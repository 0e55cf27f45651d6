"""What the HTTP app needs of an engine: the `EngineClient` protocol, its requests and errors.

Two implementations: `server.async_engine.AsyncEngine` (the engine core on a thread of
this process, the output processor on the event loop) and
`server.replicas.remote_engine.RemoteEngine` (engine replicas on Ray Serve). The app,
the endpoints, the drain and the dashboard import only this module.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from engine import RequestOutput, SamplingParams


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    priority: int = 0
    queue_timeout: float | None = None
    # time.monotonic() when it reached the engine client (set there): its queue timeout
    # and arrival order count from it, not from when the engine thread took it in.
    arrival_time: float | None = None


class EngineError(RuntimeError):
    """The engine could not finish a request."""


class RequestFailedError(EngineError):
    """A step running this request failed; the request was aborted, the engine goes on."""


class EngineDeadError(EngineError):
    """The engine loop is not running (it failed, or the server is shutting down)."""


class EngineShutdownError(EngineDeadError):
    """The server is shutting down: in-flight requests were aborted."""


class QueueTimeoutError(EngineError):
    """The request waited past its queue timeout without being scheduled."""

    def __init__(self, request_id: str, queue_timeout: float) -> None:
        super().__init__(
            f"request {request_id} waited {queue_timeout:g} s in the queue without being "
            "scheduled (queue_timeout)"
        )
        self.request_id = request_id
        self.queue_timeout = queue_timeout


SHUTDOWN_REASON = "the server is shutting down"


def dead_error(reason: str) -> EngineDeadError:
    return (EngineShutdownError if reason == SHUTDOWN_REASON else EngineDeadError)(reason)


@runtime_checkable
class EngineStream(Protocol):
    """The outputs of one HTTP request's engine requests (its n choices), in order.

    Iterating yields each `RequestOutput` as it comes and ends when all have finished;
    it raises an `EngineError` when the engine cannot finish them. `abort()` (idempotent,
    safe from a `finally` of a cancelled task) aborts whatever has not finished."""

    request_ids: list[str]

    @property
    def finished(self) -> bool: ...

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def abort(self) -> None: ...


class Metrics(Protocol):
    def render(self) -> tuple[bytes, str]: ...

    def on_grammar(self, cache_hit: bool, seconds: float) -> None: ...


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: Any
    metrics: Metrics

    # -- facts
    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    # -- health and load
    @property
    def is_alive(self) -> bool: ...

    @property
    def is_accepting(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    @property
    def died_of_failure(self) -> bool: ...

    @property
    def num_in_flight(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    # -- lifecycle
    async def start(self) -> None: ...

    def begin_drain(self) -> None: ...

    async def wait_idle(self, timeout_s: float, poll_s: float = 0.05) -> bool: ...

    def begin_shutdown(self) -> None: ...

    def shutdown(self, timeout_s: float = 30.0) -> None: ...

    # -- requests
    async def submit(self, requests: list[EngineRequest]) -> EngineStream: ...

    async def compile_grammar(self, spec: Any, timeout_s: float | None = None) -> None: ...

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine core) where the core lives (a replica set refuses: False)."""
        ...
