"""The in-process `EngineClient`: the engine core on its own thread, the output
processor on the event loop.

The engine thread (server/engine_loop.py) is the only caller of the core: token ids in,
token ids out, one call back to the event loop per step. On the event loop, the
`OutputProcessor` owns every request's text-side state (detokenizer, stop strings,
logprobs, and here its `RequestStream` and timeline): it turns the token ids into
`RequestOutput`s for the streams, and a stop string it finds becomes one abort command
to the core. So detokenizing runs beside the next forward pass, not inside the step.

A step that raises fails only the requests it ran: their streams get
`RequestFailedError` (logged once with its traceback on the engine thread) and the
engine goes on; an engine whose steps keep failing turns dead (health 503), and every
stream in flight gets `EngineDeadError`. Draining (graceful shutdown): `begin_drain()`
refuses new requests with `EngineShutdownError` while those in flight go on;
`wait_idle()` waits for them.

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
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from engine import RequestOutput
from engine.core import EngineCore
from engine.llm_engine import LLMEngine
from engine.output_processor import OutputProcessor, RequestState
from engine.outputs import EngineCoreOutput
from server.engine_client import (
    SHUTDOWN_REASON,
    EngineError,
    EngineRequest,
    QueueTimeoutError,
)
from server.engine_loop import EngineLoop, LoopCallbacks
from server.grammar_compiler import GrammarCompiler
from server.metrics import RequestTimes, ServerMetrics, StatsLogger


def _kv_blocks_of(core: EngineCore | None) -> Any:
    return core.kv_blocks if core is not None else None


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
        # Through a weak reference: the metrics are a reference cycle (their registry), and
        # must not keep the core (weights, KV pool) alive once this client is dropped.
        core_ref = weakref.ref(core)
        self.metrics.watch_kv_blocks(lambda: _kv_blocks_of(core_ref()))
        self.metrics.set_execution_plan(core.plan.info())
        callbacks = LoopCallbacks(self._on_outputs, self._fail_requests, self._fail_all)
        self._engine = EngineLoop(core, self.metrics, StatsLogger(log_interval_s), callbacks)
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
            client._engine.serve_from_this_thread(lambda: handoff.put(client))

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
        return self._engine.is_alive

    @property
    def dead_reason(self) -> str | None:
        return self._engine.dead_reason

    @property
    def is_accepting(self) -> bool:
        """Alive and not draining: what /health reports."""
        return self.is_alive and not self._engine.is_draining

    @property
    def died_of_failure(self) -> bool:
        """Dead for another reason than a requested shutdown (the process should exit 1)."""
        reason = self._engine.dead_reason
        return reason is not None and reason != SHUTDOWN_REASON

    @property
    def num_in_flight(self) -> int:
        """Engine requests submitted and not yet finished for their client."""
        return len(self._processor)

    @property
    def num_waiting(self) -> int:
        """Engine requests submitted but not yet scheduled (queued here or waiting in the core)."""
        return self._engine.num_waiting

    # -- lifecycle (event loop) --------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread, bound to the running event loop (idempotent)."""
        if self._engine.started:
            return
        self._compiler.submit(self.core.prepare_grammars)
        self._engine.start(asyncio.get_running_loop())  # a thread from `load` starts its loop

    def begin_drain(self) -> None:
        """Refuse new requests (`EngineShutdownError`); those in flight go on."""
        self._engine.begin_drain()

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
        self._engine.stop()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self.begin_shutdown()
        self._compiler.shutdown()
        if self._engine.started:  # else a thread from `load` waits, as a daemon
            self._engine.join(timeout_s)

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
        requests = [replace(r, arrival_time=arrival) for r in requests]
        for r in requests:
            client = _Client(stream, RequestTimes(arrival, r.queue_timeout))
            self._processor.add_request(r.request_id, r.prompt_token_ids, r.params, client)
        try:
            self._engine.add(requests, future)
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
        self._engine.call(fn, future)
        return await future

    def _abort_requests(self, request_ids: list[str], reason: str = "abort") -> None:
        """Finish these requests for their clients now (counted as `reason`) and abort
        them in the core."""
        states = self._processor.remove(request_ids)
        if not states:
            return
        now = time.monotonic()
        for state in states:
            self.metrics.on_request_done(state.client.times, reason, now)
        self._engine.abort([s.request_id for s in states])

    # -- outputs (event loop) ------------------------------------------------------------

    def _on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """One step's outputs: processed into text, delivered one batch per stream."""
        processed = self._processor.process(outputs)
        if processed.reqs_to_abort:  # stop strings: finished here, still running there
            self._engine.abort(processed.reqs_to_abort)
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
        then let the engine thread step again."""
        self._end_with(self._processor.remove(request_ids), "error", error)
        self._engine.failure_handled()

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
