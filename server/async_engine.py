"""The bridge between the asyncio event loop and the (not thread-safe) engine.

One engine thread is the only caller of `LLMEngine.add_request`, `abort_request`
and `step`. The event loop talks to it through a thread-safe command queue;
the thread hands each step's outputs back with `loop.call_soon_threadsafe`, one
call per step, into the per-HTTP-request `RequestStream` queues.

The thread blocks on the command queue while the engine has nothing to do (no
busy loop) and steps back to back while it has. A step that raises fails only the
requests it ran (the engine aborts them, freeing their blocks; their streams get
`RequestFailedError`, logged once with its traceback) and the loop goes on. After
`MAX_CONSECUTIVE_STEP_FAILURES` failed steps in a row the engine is taken as broken:
the bridge turns dead (health 503), fails everything in flight and queued with
`EngineDeadError`, and stays dead, so the process can exit and be restarted.

Draining (graceful shutdown): `begin_drain()` refuses new requests with
`EngineShutdownError` while those in flight go on; `wait_idle()` waits for them.

`AsyncEngine.load(build)` builds the engine on the engine thread itself, so all of the
process's torch work runs on one thread. libgomp (torch's OpenMP) keeps a team of worker
threads for each thread that opens a parallel region; with more OpenMP threads than
cores it cuts its spin-wait to a few microseconds, and each of a decode step's hundreds
of parallel regions then waits for a futex wake-up. Measured on a 2-core VM: a batch-1
int4 step of 15.3 ms when the model was loaded on the main thread, 8.7 ms when loaded on
the stepping thread (`GOMP_SPINCOUNT`, set in `engine/__init__.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine import RequestOutput, SamplingParams, StepError
from engine.memory import release_free_memory
from server.grammar_compiler import GrammarCompiler
from server.metrics import RequestTimes, ServerMetrics, StatsLogger

logger = logging.getLogger(__name__)


# Steps that may fail in a row before the engine is declared broken: one poisoned batch
# fails its requests; a device or model that fails every step ends the process.
MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineError(RuntimeError):
    """The engine could not finish a request."""


class RequestFailedError(EngineError):
    """A step running this request failed; the request was aborted, the engine goes on."""


class EngineDeadError(EngineError):
    """The engine loop is not running (it failed, or the server is shutting down)."""


class QueueTimeoutError(EngineError):
    """The request waited past its queue timeout without being scheduled."""

    def __init__(self, request_id: str, queue_timeout: float) -> None:
        super().__init__(
            f"request {request_id} waited {queue_timeout:g} s in the queue without being "
            "scheduled (queue_timeout)"
        )
        self.request_id = request_id
        self.queue_timeout = queue_timeout


class EngineShutdownError(EngineDeadError):
    """The server is shutting down: in-flight requests were aborted."""


SHUTDOWN_REASON = "the server is shutting down"


def _dead_error(reason: str) -> EngineDeadError:
    return (EngineShutdownError if reason == SHUTDOWN_REASON else EngineDeadError)(reason)


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    priority: int = 0
    queue_timeout: float | None = None


# ------------------------------------------------------------------ commands to the thread


@dataclass
class _Add:
    requests: list[EngineRequest]
    stream: RequestStream
    future: asyncio.Future
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    future: asyncio.Future


class _Stop:
    pass


class RequestStream:
    """The outputs of one HTTP request's engine requests (n choices x prompts), in order.

    Iterate it to get each `RequestOutput` as the engine produces it; iteration
    ends when every request has finished and raises `EngineDeadError` when the
    engine dies. `abort()` (idempotent, safe from a `finally` of a cancelled
    task) aborts whatever has not finished.
    """

    def __init__(self, bridge: AsyncEngine, request_ids: list[str]) -> None:
        self._bridge = bridge
        self.request_ids = list(request_ids)
        self._unfinished = set(request_ids)
        self._queue: asyncio.Queue[list[RequestOutput] | BaseException] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _put(self, item: list[RequestOutput] | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self._unfinished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._unfinished.clear()
                raise item
            for out in item:
                if out.finished:
                    self._unfinished.discard(out.request_id)
                yield out

    def abort(self) -> None:
        if self._unfinished:
            ids, self._unfinished = sorted(self._unfinished), set()
            self._bridge._send_abort(ids)


class AsyncEngine:
    """Owns the engine thread; `submit` requests, iterate their `RequestStream`."""

    def __init__(
        self,
        engine: Any,
        metrics: ServerMetrics | None = None,
        log_interval_s: float = 5.0,
    ) -> None:
        self.engine = engine
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self._stats_logger = StatsLogger(log_interval_s)
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _dead/_num_queued against the dying thread
        self._dead: str | None = None
        self._draining = False  # new requests refused, in-flight ones go on
        self._failed_steps = 0  # consecutive (engine thread)
        self._num_queued = 0  # engine requests submitted, not yet handed to the engine
        self._num_engine_waiting = 0  # waiting inside the engine (engine thread writes)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._loop_bound = threading.Event()  # `load`'s thread waits for `start`
        # Engine-thread state: which stream each live request belongs to, and its timeline.
        self._streams: dict[str, RequestStream] = {}
        self._times: dict[str, RequestTimes] = {}
        # Grammars compile here, never on the engine thread (see `compile_grammar`).
        self._compiler = GrammarCompiler()

    @classmethod
    def load(cls, build: Callable[[], Any], **kwargs: Any) -> AsyncEngine:
        """An AsyncEngine whose engine ``build()`` made on the engine thread, which then
        waits for `start` (see the module docstring); ``build``'s exception is raised here."""
        handoff: queue.SimpleQueue[Any] = queue.SimpleQueue()

        def engine_thread() -> None:
            try:
                client = cls(build(), **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                handoff.put(exc)
                return
            client._thread = threading.current_thread()
            handoff.put(client)
            client._loop_bound.wait()
            client._run()

        threading.Thread(target=engine_thread, name="engine-loop", daemon=True).start()
        result = handoff.get()
        if isinstance(result, BaseException):
            raise result
        return result

    # -- engine facts the server needs ------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        hf_config = getattr(self.engine, "hf_config", None)
        size = getattr(hf_config, "vocab_size", None)
        return int(size) if size else len(self.engine.tokenizer)

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    @property
    def is_accepting(self) -> bool:
        """Alive and not draining: what /health reports."""
        return self.is_alive and not self._draining

    @property
    def died_of_failure(self) -> bool:
        """Dead for another reason than a requested shutdown (the process should exit 1)."""
        return self._dead is not None and self._dead != SHUTDOWN_REASON

    @property
    def num_in_flight(self) -> int:
        """Engine requests submitted and not yet finished (queued here or in the engine)."""
        return self._num_queued + len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Engine requests submitted but not yet scheduled (queued here or waiting in the engine)."""
        return self._num_queued + self._num_engine_waiting

    # -- lifecycle (event loop) --------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread, bound to the running event loop (idempotent)."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        structured = getattr(self.engine, "structured_outputs", None)
        if structured is not None:  # build the grammar backend before the first request needs it
            self._compiler.submit(lambda: structured.grammars)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()
        self._loop_bound.set()  # a thread from `load` starts its loop

    def begin_drain(self) -> None:
        """Refuse new requests (`EngineShutdownError`); those in flight go on."""
        with self._lock:
            self._draining = True

    async def wait_idle(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Wait until nothing is in flight (True) or `timeout_s` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight and self.is_alive:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    def begin_shutdown(self) -> None:
        """Ask the thread to abort everything in flight and exit; does not wait."""
        with self._lock:
            if self._dead is None:
                self._commands.put(_Stop())

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self.begin_shutdown()
        self._compiler.shutdown()
        if self._loop is None:  # never started: a thread from `load` waits, as a daemon
            return
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # -- requests (event loop) -----------------------------------------------------------

    async def submit(self, requests: list[EngineRequest]) -> RequestStream:
        """Hand requests to the engine; returns once the engine accepted all of them.

        Raises ValueError (the engine's, naming the limit) when one can never run,
        none of them then stays in the engine, and EngineDeadError when the engine
        is not running.
        """
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, [r.request_id for r in requests])
        future: asyncio.Future = loop.create_future()
        self._send(_Add(requests, stream, future), num_requests=len(requests))
        try:
            await future
        except asyncio.CancelledError:
            stream.abort()  # the client left while we waited: the add may have gone through
            raise
        return stream

    async def compile_grammar(self, spec: Any) -> None:
        """Compile a request's grammar (or find it cached) before the request is submitted.

        On the compile thread: a request whose grammar compiles waits here, while the engine
        thread goes on stepping everyone else. Raises the engine's GrammarError (a ValueError
        with the compiler's message) when the spec cannot be compiled.
        """
        structured = self.engine.structured_outputs
        result = await self._compiler.run(structured.compile, spec)
        self.metrics.on_grammar(result.cache_hit, result.seconds)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread (e.g. reset_prefix_cache) and return its result."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._send(_Call(fn, future))
        return await future

    def _send(self, command: Any, num_requests: int = 0) -> None:
        with self._lock:
            if self._dead is not None:
                raise _dead_error(self._dead)
            if self._draining and num_requests:
                raise EngineShutdownError(SHUTDOWN_REASON)
            if self._thread is None:
                raise EngineDeadError("the engine loop has not been started")
            self._num_queued += num_requests
            self._commands.put(command)

    def _send_abort(self, request_ids: list[str]) -> None:
        with self._lock:
            if self._dead is None:
                self._commands.put(_Abort(request_ids))

    # -- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        reason = SHUTDOWN_REASON
        try:
            while self._handle_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step()
                    if not self.engine.has_unfinished_requests():
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
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:
                logger.exception("engine shutdown failed")

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
            self._abort(command.request_ids)
        elif isinstance(command, _Call):
            try:
                self._resolve(command.future, command.fn(self.engine), None)
            except Exception as exc:
                self._resolve(command.future, None, exc)

    def _add(self, command: _Add) -> None:
        added: list[str] = []
        error: BaseException | None = None
        try:
            for r in command.requests:
                self.engine.add_request(
                    r.request_id, r.prompt_token_ids, r.params, r.cache_salt,
                    r.priority, r.queue_timeout,
                )  # fmt: skip
                added.append(r.request_id)
        except Exception as exc:  # ValueError: impossible request; anything else: a bug
            if not isinstance(exc, ValueError):
                logger.exception("add_request failed")
            error = exc
            if added:
                self.engine.abort_request(added)
        with self._lock:
            self._num_queued -= len(command.requests)
        if error is None:
            self._num_engine_waiting += len(added)
            for r in command.requests:
                self._streams[r.request_id] = command.stream
                self._times[r.request_id] = RequestTimes(command.arrival, r.queue_timeout)
        self._resolve(command.future, None, error)

    def _abort(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if rid in self._streams]
        if not live:
            return
        self.engine.abort_request(live)
        now = time.monotonic()
        for rid in live:
            del self._streams[rid]
            self.metrics.on_request_done(self._times.pop(rid), "abort", now)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._step_failed(exc)
            return
        self._failed_steps = 0
        now = time.monotonic()
        by_stream: dict[int, tuple[RequestStream, list[RequestOutput]]] = {}
        timed_out = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finish_reason == "queue_timeout":
                timed_out.append(out.request_id)
                continue
            by_stream.setdefault(id(stream), (stream, []))[1].append(out)
            self._track(out, now)
        if by_stream:
            self._post(_deliver, list(by_stream.values()))
        for rid in timed_out:  # a whole response fails: its other choices are aborted
            if rid in self._streams:
                timeout = self._times[rid].queue_timeout or 0.0
                self._fail_requests([rid], QueueTimeoutError(rid, timeout), "queue_timeout")
        stats = self.engine.stats
        self._num_engine_waiting = stats.num_waiting
        self.metrics.on_step(stats)
        self._stats_logger.maybe_log(stats)

    def _step_failed(self, exc: Exception) -> None:
        """Fail the requests the step ran; after too many failures in a row, give up."""
        self._failed_steps += 1
        logger.error(
            "engine step failed (%d in a row); failing its requests", self._failed_steps,
            exc_info=exc,
        )  # fmt: skip
        if isinstance(exc, StepError):
            ids = exc.request_ids  # the engine aborted them already
        else:  # failed before it knew its requests: everything in flight is suspect
            ids = list(self._streams)
            self.engine.abort_request(ids)
        self._fail_requests(ids, RequestFailedError(str(exc)))
        if self._failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise _EngineBroken(
                f"{self._failed_steps} engine steps failed in a row; last: {exc}"
            ) from exc

    def _fail_requests(
        self, request_ids: list[str], error: EngineError, finish_reason: str = "error"
    ) -> None:
        """End these requests' streams with `error`; a stream's other requests (its other
        choices) cannot complete its response any more, so they are aborted too."""
        streams = {id(s): s for rid in request_ids if (s := self._streams.get(rid)) is not None}
        if not streams:
            return
        now = time.monotonic()
        for rid in request_ids:
            if self._streams.pop(rid, None) is not None:
                self.metrics.on_request_done(self._times.pop(rid), finish_reason, now)
        self._abort([rid for stream in streams.values() for rid in stream.request_ids])
        self._post(_fail_streams, list(streams.values()), error)

    def _track(self, out: RequestOutput, now: float) -> None:
        times = self._times[out.request_id]
        if times.first_token is None and out.new_token_ids:
            times.first_token = now
            self.metrics.on_first_token(times)
        times.num_tokens += len(out.new_token_ids)
        if out.finished:
            del self._streams[out.request_id]
            del self._times[out.request_id]
            self.metrics.on_request_done(times, out.finish_reason or "stop", now)

    def _refresh_idle_gauges(self) -> None:
        # Stats are a per-step snapshot; after aborts with nothing left to step, the
        # scheduler and KV manager are the live truth.
        scheduler = getattr(self.engine, "scheduler", None)
        kv = getattr(self.engine, "kv_cache_manager", None)
        waiting = scheduler.num_waiting if scheduler is not None else 0
        self._num_engine_waiting = waiting
        self.metrics.set_gauges(
            scheduler.num_running if scheduler is not None else 0,
            waiting,
            kv.usage if kv is not None else 0.0,
        )
        self._stats_logger.on_idle(self.engine.stats)

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
        live = list(self._streams)
        if live:
            try:
                self.engine.abort_request(live)
            except Exception:
                logger.exception("abort of in-flight requests failed")
        now = time.monotonic()
        for rid in live:
            self.metrics.on_request_done(self._times.pop(rid), "abort", now)
        with contextlib.suppress(Exception):  # best effort: the engine may be broken
            self._refresh_idle_gauges()
        error = _dead_error(reason)
        streams = {id(s): s for s in self._streams.values()}
        self._streams.clear()
        for command in pending:
            if isinstance(command, _Add | _Call):
                self._resolve(command.future, None, error)
        self._post(_fail_streams, list(streams.values()), error)

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


# Callbacks that run on the event loop.


def _deliver(batches: list[tuple[RequestStream, list[RequestOutput]]]) -> None:
    for stream, outputs in batches:
        stream._put(outputs)


def _fail_streams(streams: list[RequestStream], error: BaseException) -> None:
    for stream in streams:
        stream._put(error)


def _set_future(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled: the waiter is gone
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
