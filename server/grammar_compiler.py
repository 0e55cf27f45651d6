"""The grammar compile thread: idle priority, promoted while a compile waits too long.

Grammars (structured outputs) compile on one thread of their own, never on the engine
thread. It runs at Linux's SCHED_IDLE: only on a core nothing else wants, because a step's
OpenMP threads wait at a barrier for the slowest of them, so a compile that takes a core's
time slice now and then slows every step (measured on 2 cores: the p99 inter-token latency
of running streams rose 1.86x while large schemas compiled at nice 10). But SCHED_IDLE
never runs while other processes keep every core busy, and then a structured request
waits forever (the fuzz suite timed out beside two busy loops). So once any compile has
waited `PROMOTE_AFTER_S`, the thread runs as an ordinary thread at nice 19, a small but
certain share of a core, until no compile is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
PROMOTE_AFTER_S = 1.0


def _set_idle(tid: int) -> None:
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):  # not Linux: at least a lower priority
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)


def _set_lowest_normal(tid: int) -> None:
    with contextlib.suppress(OSError, AttributeError):  # allowed unprivileged: nice 19
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid, 19)


class GrammarCompiler:
    """One compile thread; `run` awaits a compile from the event loop (one loop only)."""

    def __init__(self, promote_after_s: float = PROMOTE_AFTER_S) -> None:
        self.promote_after_s = promote_after_s
        self._tid: int | None = None
        self._pending = 0  # compiles submitted by `run`, not finished (event loop state)
        self._promoted = False
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="grammar-compile", initializer=self._start_thread
        )

    def _start_thread(self) -> None:
        self._tid = threading.get_native_id()
        _set_idle(self._tid)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue work on the compile thread without waiting (e.g. a warm-up)."""
        return self._pool.submit(fn)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the compile thread."""
        loop = asyncio.get_running_loop()
        self._pending += 1
        timer = loop.call_later(self.promote_after_s, self._promote)
        try:
            return await loop.run_in_executor(self._pool, fn, *args)
        finally:
            timer.cancel()
            self._pending -= 1
            if not self._pending and self._promoted and self._tid is not None:
                _set_idle(self._tid)
                self._promoted = False

    def _promote(self) -> None:
        if self._pending and not self._promoted and self._tid is not None:
            _set_lowest_normal(self._tid)
            self._promoted = True

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
