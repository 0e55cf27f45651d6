"""The grammar compile thread is an ordinary thread at the process's priority (a Python
thread at a lowered one holds the GIL while it waits for a core, and stalls the event loop
and the engine beside busy processes). A compile that cannot start within its deadline is
`CompilerBusy`; one that runs past it is `CompileTimedOut`, and its thread is abandoned to
finish alone at idle priority while a fresh one takes the queue (a bounded number of them).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from server.grammar_compiler import CompilerBusy, CompileTimedOut, GrammarCompiler

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling")


def _policy(tid: int = 0) -> tuple[int, int]:
    """A thread's scheduling policy and nice value (0: the calling thread's)."""
    return os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)


def test_compiles_run_on_an_ordinary_thread_at_the_process_priority():
    compiler = GrammarCompiler()
    try:
        first = asyncio.run(compiler.run(_policy))
        warmed = compiler.submit(_policy).result(timeout=60)  # the warm-up's way in
    finally:
        compiler.shutdown()
    assert first == warmed == (os.SCHED_OTHER, os.getpriority(os.PRIO_PROCESS, 0))


class Stuck:
    """A compile that runs until `release` (a fake slow compile), noting its thread."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.tids: list[int] = []
        self.finished = 0

    def __call__(self) -> str:
        self.tids.append(threading.get_native_id())
        self.gate.wait(60)
        self.finished += 1
        return "late"

    def release(self) -> None:
        self.gate.set()


def test_a_compile_past_its_deadline_is_abandoned_to_a_fresh_thread():
    compiler = GrammarCompiler()
    stuck = Stuck()

    async def main() -> None:
        started = time.monotonic()
        with pytest.raises(CompileTimedOut, match="within 1 s"):
            await compiler.run(stuck, timeout_s=1)
        assert time.monotonic() - started < 30  # answered, not waiting for the compile
        assert compiler.num_abandoned == 1
        # The abandoned thread goes on with its compile, at idle priority.
        assert os.sched_getscheduler(stuck.tids[0]) == os.SCHED_IDLE
        # The queue is not stuck behind it: a fresh thread takes the next compile.
        fresh = await compiler.run(threading.get_native_id, timeout_s=30)
        assert fresh != stuck.tids[0]
        stuck.release()
        deadline = time.monotonic() + 30
        while compiler.num_abandoned and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    try:
        asyncio.run(main())
    finally:
        stuck.release()
        compiler.shutdown()
    assert stuck.finished == 1  # the late compile finished on its own
    assert compiler.num_abandoned == 0  # and its thread left


def test_past_the_abandoned_bound_the_queue_waits_and_gets_busy():
    compiler = GrammarCompiler(max_abandoned=1)
    first, second = Stuck(), Stuck()
    ran: list[str] = []

    async def main() -> str:
        with pytest.raises(CompileTimedOut):
            await compiler.run(first, timeout_s=1)  # abandoned: the one allowed
        with pytest.raises(CompileTimedOut):
            await compiler.run(second, timeout_s=1)  # kept: the bound is reached
        assert compiler.num_abandoned == 1
        with pytest.raises(CompilerBusy, match="could start"):
            await compiler.run(ran.append, "never", timeout_s=0.5)
        first.release()
        second.release()
        return await compiler.run(lambda: "served", timeout_s=30)

    try:
        assert asyncio.run(main()) == "served"
    finally:
        first.release()
        second.release()
        compiler.shutdown()
    assert ran == []  # the compile that was answered busy never ran
    assert second.tids[0] != first.tids[0]


def test_too_many_pending_compiles_are_busy_at_once():
    compiler = GrammarCompiler(max_pending=2)
    stuck = Stuck()

    async def main() -> None:
        held = [asyncio.ensure_future(compiler.run(stuck)) for _ in range(2)]
        await asyncio.sleep(0)  # both are pending
        started = time.monotonic()
        with pytest.raises(CompilerBusy, match="2 grammars are waiting"):
            await compiler.run(lambda: None, timeout_s=60)
        assert time.monotonic() - started < 30  # at once, not after its deadline
        stuck.release()
        assert await asyncio.gather(*held) == ["late", "late"]

    try:
        asyncio.run(main())
    finally:
        stuck.release()
        compiler.shutdown()


def test_without_a_deadline_a_slow_compile_is_awaited():
    compiler = GrammarCompiler()

    def slow() -> str:
        time.sleep(0.3)
        return "done"

    try:
        assert asyncio.run(compiler.run(slow)) == "done"
        assert compiler.num_abandoned == 0
    finally:
        compiler.shutdown()
