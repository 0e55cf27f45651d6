"""The engine thread: the one caller of `EngineCore.add_request`, `abort_requests` and
`step`, token ids in, token ids out (server/async_engine.py is the event loop's side).

The event loop talks to it through a thread-safe command queue (`add`, `abort`, `call`,
`stop`); the thread hands back each step's `EngineCoreOutput`s, a failed step's requests
and its own death through the callbacks it was given, each posted to the event loop with
`loop.call_soon_threadsafe` (one call per step for the outputs).

The thread blocks on the command queue while the engine has nothing to do (no busy loop)
and steps back to back while it has. A step that raises fails only the requests it ran
(the core aborts them, freeing their blocks; the event loop fails their streams, then says
`failure_handled`, and only then does the thread step again). After
`MAX_CONSECUTIVE_STEP_FAILURES` failed steps in a row the engine is taken as broken: the
loop turns dead, fails everything queued and in flight with `EngineDeadError`, and stays
dead, so the process can exit and be restarted.

Draining (graceful shutdown): after `begin_drain()` new requests are refused with
`EngineShutdownError` while those in flight go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine import StepError
from engine.core import EngineCore
from engine.memory import release_free_memory
from engine.outputs import EngineCoreOutput
from server.engine_client import (
    SHUTDOWN_REASON,
    EngineDeadError,
    EngineError,
    EngineRequest,
    EngineShutdownError,
    RequestFailedError,
    dead_error,
)
from server.metrics import ServerMetrics, StatsLogger

logger = logging.getLogger(__name__)


# Steps that may fail in a row before the engine is declared broken: one poisoned batch
# fails its requests; a device or model that fails every step ends the process.
MAX_CONSECUTIVE_STEP_FAILURES = 3


# ------------------------------------------------------------------ commands to the thread


@dataclass
class _Add:
    requests: list[EngineRequest]
    future: asyncio.Future


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[EngineCore], Any]
    future: asyncio.Future


class _Stop:
    pass


class _FailureHandled:
    """The event loop has failed a failed step's requests and aborted their siblings
    (the other choices of their responses): the engine thread may step again."""


@dataclass(frozen=True)
class LoopCallbacks:
    """What the engine thread reports, each called on the event loop."""

    on_outputs: Callable[[list[EngineCoreOutput]], None]  # one step's outputs
    # A failed step's requests (the core aborted them): end them, then `failure_handled`.
    on_step_failed: Callable[[list[str], EngineError], None]
    on_dead: Callable[[EngineDeadError], None]  # everything in flight ends with it


def _ignore(*_: Any) -> None:
    pass


_DETACHED = LoopCallbacks(_ignore, _ignore, _ignore)  # a stopped loop's: nothing to report


class EngineLoop:
    """The engine thread and its command queue. Its public methods are called from the
    event loop (or any thread); the rest runs on the engine thread."""

    def __init__(
        self,
        core: EngineCore,
        metrics: ServerMetrics,
        stats_logger: StatsLogger,
        callbacks: LoopCallbacks,
    ) -> None:
        self.core = core
        self._metrics = metrics
        self._stats_logger = stats_logger
        self._callbacks = callbacks
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _dead/_num_queued against the dying thread
        self._dead: str | None = None
        self._draining = False  # new requests refused, in-flight ones go on
        self._failed_steps = 0  # consecutive (engine thread)
        self._awaiting_failure_handled = False  # (engine thread) see `_FailureHandled`
        self._num_queued = 0  # engine requests submitted, not yet handed to the core
        self._num_engine_waiting = 0  # waiting inside the core (engine thread writes)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._loop_bound = threading.Event()  # a thread of `serve_from_this_thread` waits

    # -- state (any thread) --------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._loop is not None

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    @property
    def is_draining(self) -> bool:
        return self._draining

    @property
    def num_waiting(self) -> int:
        """Engine requests submitted but not yet scheduled (queued here or waiting in the core)."""
        return self._num_queued + self._num_engine_waiting

    # -- lifecycle -------------------------------------------------------------------------

    def serve_from_this_thread(self, ready: Callable[[], None]) -> None:
        """Make the calling thread the engine thread: call `ready()`, wait for `start`,
        then run the loop until it stops."""
        self._thread = threading.current_thread()
        ready()
        self._loop_bound.wait()
        self._run()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind the event loop the callbacks run on and start the loop: on its own new
        thread, unless `serve_from_this_thread` gave it one."""
        self._loop = loop
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()
        self._loop_bound.set()

    def begin_drain(self) -> None:
        with self._lock:
            self._draining = True

    def stop(self) -> None:
        """Ask the thread to abort everything in flight and exit; does not wait."""
        self._send_if_alive(_Stop())

    def join(self, timeout_s: float) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # -- commands --------------------------------------------------------------------------

    def add(self, requests: list[EngineRequest], future: asyncio.Future) -> None:
        """Hand requests to the core; `future` resolves once it accepted all of them (or
        with its ValueError, none of them then staying). Raises EngineDeadError (or
        EngineShutdownError while draining) when it cannot take them."""
        self._send(_Add(requests, future), num_requests=len(requests))

    def call(self, fn: Callable[[EngineCore], Any], future: asyncio.Future) -> None:
        """Run fn(core) on the engine thread, between steps; `future` gets its result."""
        self._send(_Call(fn, future))

    def abort(self, request_ids: list[str]) -> None:
        self._send_if_alive(_Abort(request_ids))

    def failure_handled(self) -> None:
        """A failed step's requests are ended for their clients: step again."""
        self._send_if_alive(_FailureHandled())

    def _send(self, command: Any, num_requests: int = 0) -> None:
        with self._lock:
            if self._dead is not None:
                raise dead_error(self._dead)
            if self._draining and num_requests:
                raise EngineShutdownError(SHUTDOWN_REASON)
            if self._thread is None:
                raise EngineDeadError("the engine loop has not been started")
            self._num_queued += num_requests
            self._commands.put(command)

    def _send_if_alive(self, command: Any) -> None:
        with self._lock:
            if self._dead is None:
                self._commands.put(command)

    # -- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        reason = SHUTDOWN_REASON
        core = self.core
        try:
            while self._handle_commands(block=self._idle()):
                if not self._idle():
                    self._step()
                    if not core.has_unfinished_requests():
                        release_free_memory()  # once per busy period: engine/memory.py
                else:
                    self._refresh_idle_gauges()
        except _EngineBroken as exc:  # each failed step was logged with its traceback
            logger.error("engine loop stopped: %s", exc)
            reason = str(exc)
        except BaseException as exc:  # noqa: BLE001 - any failure kills the loop, reported
            logger.exception("engine loop died")
            reason = f"engine loop died: {type(exc).__name__}: {exc}"
        self._die(reason)
        # From this thread, the one that stepped: tensor-parallel workers wait on its
        # broadcasts, and a broadcast of None stops them.
        try:
            core.shutdown()
        except Exception:
            logger.exception("engine shutdown failed")
        # The callbacks are bound methods of the client that owns this loop: dropped, the
        # pair is no reference cycle, and the model's memory goes with the client, without
        # waiting for a full garbage collection (an unloaded model: server/model_router.py).
        self._callbacks = _DETACHED

    def _idle(self) -> bool:
        """Nothing to step: no unfinished request, or a failed step's siblings are still
        to be aborted (stepping them could fail again, for the same cause)."""
        return self._awaiting_failure_handled or not self.core.has_unfinished_requests()

    def _handle_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for one when `block`); False on a stop command."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, command: Any) -> None:
        if isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            self.core.abort_requests(command.request_ids)
        elif isinstance(command, _FailureHandled):
            self._awaiting_failure_handled = False
        elif isinstance(command, _Call):
            try:
                self._resolve(command.future, command.fn(self.core), None)
            except Exception as exc:
                self._resolve(command.future, None, exc)

    def _add(self, command: _Add) -> None:
        added: list[str] = []
        error: BaseException | None = None
        try:
            for r in command.requests:
                self.core.add_request(
                    r.request_id, r.prompt_token_ids, r.params, r.cache_salt,
                    r.priority, r.queue_timeout, r.arrival_time,
                )  # fmt: skip
                added.append(r.request_id)
        except Exception as exc:  # ValueError: impossible request; anything else: a bug
            if not isinstance(exc, ValueError):
                logger.exception("add_request failed")
            error = exc
            if added:
                self.core.abort_requests(added)
        with self._lock:
            self._num_queued -= len(command.requests)
        if error is None:
            self._num_engine_waiting += len(added)
        self._resolve(command.future, None, error)

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as exc:
            self._step_failed(exc)
            return
        self._failed_steps = 0
        if outputs:
            self._post(self._callbacks.on_outputs, outputs)
        stats = self.core.stats
        self._num_engine_waiting = stats.num_waiting
        self._metrics.on_step(stats)
        self._stats_logger.maybe_log(stats)

    def _step_failed(self, exc: Exception) -> None:
        """Fail the requests the step ran; after too many failures in a row, give up."""
        self._failed_steps += 1
        logger.error(
            "engine step failed (%d in a row); failing its requests", self._failed_steps,
            exc_info=exc,
        )  # fmt: skip
        if isinstance(exc, StepError):
            ids = exc.request_ids  # the core aborted them already
        else:  # failed before it knew its requests: everything in flight is suspect
            ids = self.core.unfinished_request_ids
            self.core.abort_requests(ids)
        self._awaiting_failure_handled = True
        self._post(self._callbacks.on_step_failed, ids, RequestFailedError(str(exc)))
        if self._failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise _EngineBroken(
                f"{self._failed_steps} engine steps failed in a row; last: {exc}"
            ) from exc

    def _refresh_idle_gauges(self) -> None:
        # Stats are a per-step snapshot; after aborts with nothing left to step they are stale.
        stats = self.core.refresh_stats()
        self._num_engine_waiting = stats.num_waiting
        self._metrics.set_gauges(stats.num_running, stats.num_waiting, stats.kv_cache_usage)
        self._stats_logger.on_idle(stats)

    def _die(self, reason: str) -> None:
        """Fail everything in flight and everything queued; refuse all later commands."""
        with self._lock:
            self._dead = reason
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            self._num_queued = 0
        try:
            self.core.abort_requests(self.core.unfinished_request_ids)
        except Exception:
            logger.exception("abort of in-flight requests failed")
        with contextlib.suppress(Exception):  # best effort: the engine may be broken
            self._refresh_idle_gauges()
        error = dead_error(reason)
        for command in pending:
            if isinstance(command, _Add | _Call):
                self._resolve(command.future, None, error)
        self._post(self._callbacks.on_dead, error)

    def _resolve(self, future: asyncio.Future, result: Any, error: BaseException | None) -> None:
        self._post(_set_future, future, result, error)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # RuntimeError: the loop closed between the check and the call.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(fn, *args)


class _EngineBroken(RuntimeError):
    """Raised on the engine thread when steps keep failing: the loop stops."""


def _set_future(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled: the waiter is gone
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
