"""The in-process `EngineClient`: the engine core on its own thread, the output
processor on the event loop.

One engine thread is the only caller of `EngineCore.add_request`, `abort_requests` and
`step`: token ids in, token ids out. The event loop talks to it through a thread-safe
command queue; the thread hands each step's `EngineCoreOutput`s back with
`loop.call_soon_threadsafe`, one call per step. On the event loop, the
`OutputProcessor` owns every request's text-side state (detokenizer, stop strings,
logprobs, and here its `RequestStream` and timeline): it turns the token ids into
`RequestOutput`s for the streams, and a stop string it finds becomes one abort command
to the core. So detokenizing runs beside the next forward pass, not inside the step.

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
from dataclasses import dataclass
from typing import Any

from engine import RequestOutput, StepError
from engine.core import EngineCore
from engine.llm_engine import LLMEngine
from engine.memory import release_free_memory
from engine.output_processor import OutputProcessor, RequestState
from engine.outputs import EngineCoreOutput
from server.engine_client import (
    SHUTDOWN_REASON,
    EngineDeadError,
    EngineError,
    EngineRequest,
    EngineShutdownError,
    QueueTimeoutError,
    RequestFailedError,
    dead_error,
)
from server.grammar_compiler import GrammarCompiler
from server.metrics import RequestTimes, ServerMetrics, StatsLogger

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


class RequestStream:
    """The outputs of one HTTP request's engine requests (n choices x prompts), in order
    (an `EngineStream`).

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
            self._bridge._abort_requests(ids)


@dataclass(slots=True)
class _Client:
    """What the server keeps with a request's output state: where its outputs go, and
    its timeline for the metrics."""

    stream: RequestStream
    times: RequestTimes


class AsyncEngine:
    """Owns the engine thread; `submit` requests, iterate their `RequestStream`."""

    def __init__(
        self,
        core: EngineCore | LLMEngine,
        metrics: ServerMetrics | None = None,
        log_interval_s: float = 5.0,
        grammar_compiler: GrammarCompiler | None = None,
    ) -> None:
        """`core`: the engine core; an offline `LLMEngine` stands for its core (the
        output processing is this class's own, on the event loop). `grammar_compiler`:
        the compile thread's limits (default: `GrammarCompiler()`'s)."""
        if isinstance(core, LLMEngine):
            core = core.core
        self.core = core
        self.tokenizer = core.tokenizer
        self.metrics = metrics if metrics is not None else ServerMetrics()
        # /metrics reads the pool's block counts the core last published (an immutable
        # object it replaces), so they are right before the first step and after aborts.
        self.metrics.watch_kv_blocks(lambda: core.kv_blocks)
        self._stats_logger = StatsLogger(log_interval_s)
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
        self._loop_bound = threading.Event()  # `load`'s thread waits for `start`
        # Event-loop state: every submitted, unfinished request's text side and client.
        self._processor: OutputProcessor[_Client] = OutputProcessor(core.tokenizer)
        # Grammars compile here, never on the engine thread (see `compile_grammar`).
        self._compiler = grammar_compiler or GrammarCompiler()

    @classmethod
    def load(cls, build: Callable[[], EngineCore], **kwargs: Any) -> AsyncEngine:
        """An AsyncEngine whose core ``build()`` made on the engine thread, which then
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
    def model_name(self) -> str:
        return self.core.model_name

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

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
        """Engine requests submitted and not yet finished for their client."""
        return len(self._processor)

    @property
    def num_waiting(self) -> int:
        """Engine requests submitted but not yet scheduled (queued here or waiting in the core)."""
        return self._num_queued + self._num_engine_waiting

    # -- lifecycle (event loop) --------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread, bound to the running event loop (idempotent)."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._compiler.submit(self.core.prepare_grammars)
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
        """Hand requests to the engine; returns once the core accepted all of them.

        Raises ValueError (the core's, naming the limit) when one can never run, none of
        them then stays in the engine, and EngineDeadError when the engine is not running.
        """
        loop = asyncio.get_running_loop()
        ids = [r.request_id for r in requests]
        stream = RequestStream(self, ids)
        future: asyncio.Future = loop.create_future()
        # Registered before the core can step them: their first outputs find their state.
        arrival = time.monotonic()
        for r in requests:
            client = _Client(stream, RequestTimes(arrival, r.queue_timeout))
            self._processor.add_request(r.request_id, r.prompt_token_ids, r.params, client)
        try:
            self._send(_Add(requests, future), num_requests=len(requests))
            await future
        except asyncio.CancelledError:
            stream.abort()  # the client left while we waited: the add may have gone through
            raise
        except BaseException:
            self._processor.remove(ids)  # refused: nothing of them stays
            raise
        return stream

    async def compile_grammar(self, spec: Any, timeout_s: float | None = None) -> None:
        """Compile a request's grammar (or find it cached) before the request is submitted.

        On the compile thread: a request whose grammar compiles waits here, while the engine
        thread goes on stepping everyone else. Raises the engine's GrammarError (a ValueError
        with the compiler's message) when the spec cannot be compiled; with `timeout_s`,
        CompilerBusy or CompileTimedOut (server/grammar_compiler.py) past it.
        """
        result = await self._compiler.run(self.core.compile_grammar, spec, timeout_s=timeout_s)
        self.metrics.on_grammar(result.cache_hit, result.seconds)

    async def call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run fn(core) on the engine thread (e.g. reset_prefix_cache) and return its result."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._send(_Call(fn, future))
        return await future

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

    def _abort_requests(self, request_ids: list[str], reason: str = "abort") -> None:
        """Finish these requests for their clients now (counted as `reason`) and abort
        them in the core."""
        states = self._processor.remove(request_ids)
        if not states:
            return
        now = time.monotonic()
        for state in states:
            self.metrics.on_request_done(state.client.times, reason, now)
        self._abort_in_core([s.request_id for s in states])

    def _abort_in_core(self, request_ids: list[str]) -> None:
        with self._lock:
            if self._dead is None:
                self._commands.put(_Abort(request_ids))

    # -- outputs (event loop) ------------------------------------------------------------

    def _on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """One step's outputs: processed into text, delivered one batch per stream."""
        processed = self._processor.process(outputs)
        if processed.reqs_to_abort:  # stop strings: finished here, still running there
            self._abort_in_core(processed.reqs_to_abort)
        now = time.monotonic()
        batches: dict[int, tuple[RequestStream, list[RequestOutput]]] = {}
        timed_out: list[RequestState[_Client]] = []
        for state, out in processed.outputs:
            if out.finish_reason == "queue_timeout":
                timed_out.append(state)
                continue
            self._track(state.client.times, out, now)
            stream = state.client.stream
            batches.setdefault(id(stream), (stream, []))[1].append(out)
        for stream, batch in batches.values():
            stream._put(batch)
        for state in timed_out:  # a whole response fails: its other choices are aborted
            times = state.client.times
            self.metrics.on_request_done(times, "queue_timeout", now)
            error = QueueTimeoutError(state.request_id, times.queue_timeout or 0.0)
            self._fail_streams([state.client.stream], error)

    def _track(self, times: RequestTimes, out: RequestOutput, now: float) -> None:
        if times.first_token is None and out.new_token_ids:
            times.first_token = now
            self.metrics.on_first_token(times)
        times.num_tokens += len(out.new_token_ids)
        if out.finished:
            self.metrics.on_request_done(times, out.finish_reason or "stop", now)

    def _fail_requests(self, request_ids: list[str], error: EngineError) -> None:
        """End a failed step's requests (the core aborted them) with `error`, as "error";
        then let the engine thread step again (`_FailureHandled`)."""
        self._end_with(self._processor.remove(request_ids), "error", error)
        with self._lock:
            if self._dead is None:
                self._commands.put(_FailureHandled())

    def _fail_streams(self, streams: list[RequestStream], error: BaseException) -> None:
        """End these streams with `error`; their other requests (other choices) cannot
        complete their responses any more, so they are aborted."""
        unique = {id(s): s for s in streams}
        for stream in unique.values():
            self._abort_requests(stream.request_ids)
            stream._put(error)

    def _fail_all(self, error: BaseException) -> None:
        """The engine died: every request in flight ends with `error`, counted as aborted."""
        self._end_with(self._processor.remove_all(), "abort", error)

    def _end_with(
        self, states: list[RequestState[_Client]], reason: str, error: BaseException
    ) -> None:
        """Count these (removed) requests as ended for `reason`; fail their streams."""
        now = time.monotonic()
        for state in states:
            self.metrics.on_request_done(state.client.times, reason, now)
        self._fail_streams([s.client.stream for s in states], error)

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
                    r.priority, r.queue_timeout,
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
            self._post(self._on_outputs, outputs)
        stats = self.core.stats
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
            ids = exc.request_ids  # the core aborted them already
        else:  # failed before it knew its requests: everything in flight is suspect
            ids = self.core.unfinished_request_ids
            self.core.abort_requests(ids)
        self._awaiting_failure_handled = True
        self._post(self._fail_requests, ids, RequestFailedError(str(exc)))
        if self._failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise _EngineBroken(
                f"{self._failed_steps} engine steps failed in a row; last: {exc}"
            ) from exc

    def _refresh_idle_gauges(self) -> None:
        # Stats are a per-step snapshot; after aborts with nothing left to step they are stale.
        stats = self.core.refresh_stats()
        self._num_engine_waiting = stats.num_waiting
        self.metrics.set_gauges(stats.num_running, stats.num_waiting, stats.kv_cache_usage)
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
        self._post(self._fail_all, error)

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
