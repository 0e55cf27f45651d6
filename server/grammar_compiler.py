"""The grammar compile thread: idle priority, promoted while a compile waits, and a
deadline on every compile.

Grammars (structured outputs) compile on one thread of their own, never on the engine
thread. It runs at Linux's SCHED_IDLE: only on a core nothing else wants, because a step's
OpenMP threads wait at a barrier for the slowest of them, so a compile that takes a core's
time slice now and then slows every step (measured on 2 cores: the p99 inter-token latency
of running streams rose 1.86x while large schemas compiled at nice 10). But SCHED_IDLE
never runs while other processes keep every core busy, and then a structured request
waits forever (the fuzz suite timed out beside two busy loops). Nor is nice 19 enough:
its weight is 15 against 1024 for each nice-0 process, and beside a parallel native
build (load ~6 on 2 cores) one compile waited past its client's 120 s. So while any
compile has waited, the thread climbs `PROMOTIONS`: an ordinary thread at nice 19 after
1 s, at nice 0 (a fair share of a core) after 4 s; it goes back to idle once no compile
is left. Leaving SCHED_IDLE and lowering a nice value need CAP_SYS_NICE (or RLIMIT_NICE):
without them the thread stays where it is.

A compile may also have a deadline (`run`'s `timeout_s`, the server's
--grammar-compile-timeout). One that cannot start within it (others ahead of it), or that
comes while `max_pending` compiles wait already, raises `CompilerBusy` (503, retry later);
one that started and runs longer than it raises `CompileTimedOut` (400: the spec costs
too much). A Python thread cannot be stopped, so the overrunning compile's thread is
abandoned: it finishes on its own at idle priority (its grammar still lands in the cache)
while a fresh thread takes the queue. At most `max_abandoned` of them run at once; past
that the thread is kept, and the compiles behind it get `CompilerBusy` at their deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
# (seconds a compile has waited, the nice value the thread then runs at as an ordinary one)
PROMOTIONS: tuple[tuple[float, int], ...] = ((1.0, 19), (4.0, 0))
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


def _set_ordinary(tid: int, nice: int) -> None:
    # The nice value first, so the thread is never an ordinary one at a lower value than
    # asked. Either call fails with EPERM without the privilege: the thread stays as it was.
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))


def _set_priority(tid: int, nice: int | None) -> None:
    """None: SCHED_IDLE; else an ordinary thread at this nice value."""
    if nice is None:
        _set_idle(tid)
    else:
        _set_ordinary(tid, nice)


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

    def __init__(
        self,
        promotions: Sequence[tuple[float, int]] = PROMOTIONS,
        max_pending: int = MAX_PENDING,
        max_abandoned: int = MAX_ABANDONED,
    ) -> None:
        self.promotions = promotions
        self.max_pending = max_pending
        self.max_abandoned = max_abandoned
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # _tid and _nice, against a thread that starts
        self._tid: int | None = None  # the current thread's native id, once it runs
        self._nice: int | None = None  # the current thread's priority (`_set_priority`)
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
        with self._lock:  # a fresh thread starts where the one it replaces was
            self._tid = threading.get_native_id()
            _set_priority(self._tid, self._nice)
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
        loop = asyncio.get_running_loop()
        job = _Job(fn, args)
        waiter = asyncio.wrap_future(job.future)
        waiter.add_done_callback(_retrieve)
        self._queue.put(job)
        self._pending += 1
        timers = [loop.call_later(after, self._promote, nice) for after, nice in self.promotions]
        try:
            if timeout_s is not None:
                await self._wait(job, waiter, timeout_s)
            return await waiter
        finally:
            job.future.cancel()  # one not taken yet (its client left) is never run
            for timer in timers:
                timer.cancel()
            self._pending -= 1
            if not self._pending and self._nice is not None:
                self._set_nice(None)

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

    def _promote(self, nice: int) -> None:
        if self._pending and (self._nice is None or nice < self._nice):
            self._set_nice(nice)

    def _set_nice(self, nice: int | None) -> None:
        with self._lock:
            self._nice = nice
            if self._tid is not None:
                _set_priority(self._tid, nice)

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
