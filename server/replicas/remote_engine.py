"""The ingress's engine client: what `server.app` needs of an engine, over Ray Serve.

The HTTP app is the single server's, unchanged: it validates, tokenizes and renders; this
class is its `EngineClient` (server/engine_client.py) in place of the local
`AsyncEngine`. `submit` sends one HTTP request's engine requests (its n choices) to one
replica through the deployment handle, as a streaming call, so the router sees their
prompt; the replica answers first with an empty batch once its engine accepted them (or
raises the engine's ValueError: a 400), then streams outputs. `abort()` cancels the call; the replica's generator then aborts its requests
and frees their blocks, exactly as a disconnect does on one server.

A replica that dies mid-request fails that request (500 `engine_error`, or an error
event in a stream): half a response cannot be replayed elsewhere. Ray Serve restarts
the replica; requests that arrive meanwhile go to the others.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from engine import RequestOutput
from engine.structured_output import StructuredOutputManager
from server.engine_client import (
    EngineDeadError,
    EngineError,
    EngineRequest,
    EngineShutdownError,
    RequestFailedError,
)
from server.grammar_compiler import CompileTimedOut
from server.replicas.metrics import ReplicaMetrics


class RemoteStream:
    """One HTTP request's outputs from its replica (an `EngineStream`)."""

    def __init__(self, response: Any, request_ids: list[str], on_done: Callable[[], None]):
        self._response = response
        self.request_ids = list(request_ids)
        self._unfinished = set(request_ids)
        self._on_done = on_done

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            async for batch in self._response:
                for out in batch:
                    if out.finished:
                        self._unfinished.discard(out.request_id)
                    yield out
                if not self._unfinished:
                    break
        except EngineError:
            raise
        except (RayActorError, RayTaskError) as exc:  # the replica died or its call failed
            raise RequestFailedError(f"the replica serving this request failed: {exc}") from exc
        finally:
            self._close()

    def abort(self) -> None:
        if self._unfinished:
            self._unfinished = set()
            self._response.cancel()
        self._close()

    def _close(self) -> None:
        if self._on_done is not None:
            self._on_done()
            self._on_done = None


class RemoteEngine:
    """The app's `EngineClient` over engine replicas (`facts`: a replica's
    `describe()`; `tokenizer`: the same model's, loaded in the ingress)."""

    def __init__(self, handle: Any, tokenizer: Any, facts: dict[str, Any]) -> None:
        self._handle = handle.options(stream=True)
        self.tokenizer = tokenizer
        self.model_name: str = facts["model_name"]
        self.max_model_len: int = facts["max_model_len"]
        self.vocab_size: int = facts["vocab_size"]
        self.metrics = ReplicaMetrics()
        # Grammars are compiled here too, to answer a bad one with a 400 before routing; the
        # replica compiles its own copy on its compile thread.
        self._grammars = StructuredOutputManager(tokenizer, self.vocab_size, facts["eos_token_ids"])
        self._in_flight = 0
        self._draining = False
        self.dead_reason: str | None = None

    # -- lifecycle: Ray Serve owns the replicas, so these only track this ingress ---------

    async def start(self) -> None:
        return None

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self._draining = True

    def begin_shutdown(self) -> None:
        self._draining = True

    def begin_drain(self) -> None:
        self._draining = True

    async def wait_idle(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._in_flight:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    @property
    def is_alive(self) -> bool:
        return True

    @property
    def is_accepting(self) -> bool:
        return not self._draining

    @property
    def died_of_failure(self) -> bool:
        return False

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    @property
    def num_waiting(self) -> int:
        return self.metrics.num_waiting()

    # -- requests -----------------------------------------------------------------------

    async def submit(self, requests: list[EngineRequest]) -> RemoteStream:
        if self._draining:
            raise EngineShutdownError("the server is shutting down")
        response = self._handle.generate.remote(requests)
        try:
            await response.__anext__()  # the replica's "accepted" (or its ValueError)
        except ValueError:
            raise
        except (RayActorError, RayTaskError) as exc:
            raise EngineDeadError(f"no replica could take the request: {exc}") from exc
        self._in_flight += 1
        return RemoteStream(response, [r.request_id for r in requests], self._done)

    def _done(self) -> None:
        self._in_flight -= 1

    async def compile_grammar(self, spec: Any, timeout_s: float | None = None) -> None:
        # A check on the default executor (this process runs no step, so no idle thread);
        # one that overruns is left to finish on its own, as GrammarCompiler leaves it.
        try:
            await asyncio.wait_for(asyncio.to_thread(self._grammars.compile, spec), timeout_s)
        except TimeoutError:
            raise CompileTimedOut(f"did not compile within {timeout_s:g} s") from None

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Engine calls (`/reset_prefix_cache`) would reach one replica of N: refused."""
        return False
