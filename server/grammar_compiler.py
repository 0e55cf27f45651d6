"""The grammar compile thread: an ordinary thread, and a deadline on every compile.

Grammars (structured outputs) compile on one thread of their own, never on the engine
thread. It runs at the process's own priority. It once ran at SCHED_IDLE (promoted to
nice 19, then 0, while a compile waited), so that a compile took no core a step wanted;
but a thread in this process that runs Python at a lowered priority holds the GIL while
the kernel keeps it off the cores, and every other thread (the event loop, the engine)
waits for it. Beside two busy processes on 2 cores (2026-11-27, bench/README.md) the idle
thread made the first stream after start-up (the compiler's warm-up builds the tokenizer
info in Python) take 14-19 s instead of 3-4 s, with gaps of 1.5-2.4 s between its tokens,
and the p99 inter-token latency of streams while schemas compiled 1.4-1.6 s instead of
0.32-0.33 s. On the same machine idle, the ordinary thread costs streams a higher p50
inter-token latency while large schemas compile (49-52 ms against 33-37; p99 within
noise), and compiles take 1.34 s instead of 1.85-1.93 s.

A compile may also have a deadline (`run`'s `timeout_s`, the server's
--grammar-compile-timeout). One that cannot start within it (others ahead of it), or that
comes while `max_pending` compiles wait already, raises `CompilerBusy` (503, retry later);
one that started and runs longer than it raises `CompileTimedOut` (400: the spec costs
too much). A Python thread cannot be stopped, so the overrunning compile's thread is
abandoned: it finishes on its own (its grammar still lands in the cache) while a fresh
thread takes the queue. At most `max_abandoned` of them run at once; past that the thread
is kept, and the compiles behind it get `CompilerBusy` at their deadlines. An abandoned
thread drops to SCHED_IDLE: a hostile schema must not keep a core, and its compile is
native code that holds no GIL (xgrammar releases it), so only the few lines of Python
after the compile returns can hold the other threads up, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
MAX_PENDING = 64  # compiles waiting or running; one more is CompilerBusy at once
MAX_ABANDONED = 2  # overrunning compiles left to finish on their own threads


class CompilerBusy(RuntimeError):
    """The compile could not start in time, or too many wait: the server is too busy."""


class CompileTimedOut(TimeoutError):
    """The compile ran longer than its deadline allows."""


def _set_idle(tid: int) -> None:
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):  # not Linux: at least a lower priority
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)


def _retrieve(waiter: asyncio.Future) -> None:
    # A waiter nobody awaits any more (its compile overran) must not log its exception.
    if not waiter.cancelled():
        waiter.exception()


class _Job:
    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.future: Future[Any] = Future()
        self.thread: threading.Thread | None = None  # the thread that took it
        self.started_at = 0.0  # time.monotonic() when it was taken


def _run(job: _Job, thread: threading.Thread) -> None:
    job.thread, job.started_at = thread, time.monotonic()
    if not job.future.set_running_or_notify_cancel():
        return  # its waiter gave up on it
    # The function (a bound method of an engine core) is let go before the waiter wakes:
    # the job outlives the call, and an unloaded model's core must not (model_router.py).
    fn, args, job.fn, job.args = job.fn, job.args, _spent, ()
    error: BaseException | None = None
    try:
        result = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - handed to the waiter
        result, error = None, exc
    del fn, args
    if error is not None:
        job.future.set_exception(error)
    else:
        job.future.set_result(result)


def _spent(*_: Any) -> None:
    """A job's function once it has been called."""


class GrammarCompiler:
    """One compile thread; `run` awaits a compile from the event loop (one loop only)."""

    def __init__(self, max_pending: int = MAX_PENDING, max_abandoned: int = MAX_ABANDONED) -> None:
        self.max_pending = max_pending
        self.max_abandoned = max_abandoned
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # _tid, against a thread that starts
        self._tid: int | None = None  # the current thread's native id, once it runs
        self._pending = 0  # compiles in `run` (event loop state)
        self._abandoned: list[threading.Thread] = []  # (event loop state)
        self._worker: threading.Thread
        self._start_worker()

    def _start_worker(self) -> None:
        # A daemon thread, not an executor's: those are joined at exit, and a compile that
        # never ends would then hold the process. `_worker` is set before it starts: a
        # thread that is not `_worker` leaves.
        self._worker = threading.Thread(target=self._work, name="grammar-compile", daemon=True)
        self._worker.start()

    def _work(self) -> None:
        me = threading.current_thread()
        with self._lock:
            self._tid = threading.get_native_id()
        while me is self._worker:  # an abandoned thread leaves after its compile
            job = self._queue.get()
            if job is None:
                return
            _run(job, me)
            del job  # not kept while the next one is awaited (see `_run`)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue work on the compile thread without waiting (e.g. a warm-up)."""
        job = _Job(fn, ())
        self._queue.put(job)
        return job.future

    async def run(self, fn: Callable[..., T], *args: Any, timeout_s: float | None = None) -> T:
        """fn(*args) on the compile thread. With `timeout_s`: `CompilerBusy` when it cannot
        start within that many seconds, `CompileTimedOut` when it runs longer than that."""
        if self._pending >= self.max_pending:
            raise CompilerBusy(f"{self._pending} grammars are waiting to compile")
        job = _Job(fn, args)
        waiter = asyncio.wrap_future(job.future)
        waiter.add_done_callback(_retrieve)
        self._queue.put(job)
        self._pending += 1
        try:
            if timeout_s is not None:
                await self._wait(job, waiter, timeout_s)
            return await waiter
        finally:
            job.future.cancel()  # one not taken yet (its client left) is never run
            self._pending -= 1

    async def _wait(self, job: _Job, waiter: asyncio.Future, timeout_s: float) -> None:
        done, _ = await asyncio.wait({waiter}, timeout=timeout_s)
        if done:
            return
        if job.future.cancel():  # not started: now it never will be
            raise CompilerBusy(f"no grammar could start compiling within {timeout_s:g} s")
        left = job.started_at + timeout_s - time.monotonic()  # it runs timeout_s at most
        if left > 0:
            done, _ = await asyncio.wait({waiter}, timeout=left)
        if not done and not job.future.done():
            self._abandon(job)
            raise CompileTimedOut(f"did not compile within {timeout_s:g} s")

    def _abandon(self, job: _Job) -> None:
        """Leave the thread running `job` to finish it alone, at idle priority (its client
        has had its answer), and start a fresh thread for the queue; unless `max_abandoned`
        are still running: then the queue waits for this one."""
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        if job.thread is not self._worker or len(self._abandoned) >= self.max_abandoned:
            return
        with self._lock:
            self._abandoned.append(self._worker)
            if self._tid is not None:
                _set_idle(self._tid)
            self._tid = None
            self._start_worker()

    @property
    def num_abandoned(self) -> int:
        """Abandoned threads still running their compile."""
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return len(self._abandoned)

    def shutdown(self) -> None:
        """Cancel the compiles not started and let the threads end (none is waited for)."""
        with contextlib.suppress(queue.Empty):
            while True:
                job = self._queue.get_nowait()
                if job is not None:
                    job.future.cancel()
        for _ in range(1 + len(self._abandoned)):  # whichever thread takes it leaves
            self._queue.put(None)
