"""The grammar compile thread runs at idle priority, and climbs to ordinary nice 19, then
nice 0, while a compile has waited past each promotion delay (so a machine kept busy by
other processes cannot starve structured requests). A compile that cannot start within
its deadline is `CompilerBusy`; one that runs past it is `CompileTimedOut`, and its thread
is abandoned to finish alone while a fresh one takes the queue (a bounded number of them).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from server.grammar_compiler import CompilerBusy, CompileTimedOut, GrammarCompiler

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling")
NEVER = ((3600.0, 19),)  # a promotion delay no test reaches
# Promoted at once: a compile is taken within its deadline even beside busy processes
# (an idle thread would not run at all there, and the compile would be `CompilerBusy`).
AT_ONCE = ((0.0, 0),)
# Lowering a nice value (19 -> 0) needs CAP_SYS_NICE; as root here and in CI.
PRIVILEGED = os.geteuid() == 0


def _policy(tid: int = 0) -> tuple[int, int]:
    """A thread's scheduling policy and nice value (0: the calling thread's)."""
    return os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)


def _wait_for_policy(expected: tuple[int, int], timeout_s: float = 30) -> tuple[int, int]:
    """The calling thread's policy once it is `expected`, or whatever it is after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while _policy() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return _policy()


def test_compiles_run_idle_and_a_long_wait_climbs_until_none_is_left():
    # The quick compiles get a delay no busy machine reaches: an idle thread waits for a
    # free core, and one that waited past a delay is promoted, as it should be.
    compiler = GrammarCompiler(promotions=NEVER)

    async def main() -> list[tuple[int, int]]:
        quick = await compiler.run(_policy)
        compiler.promotions = ((0.05, 19), (0.3, 0))
        at_19 = await compiler.run(_wait_for_policy, (os.SCHED_OTHER, 19))
        at_0 = await compiler.run(_wait_for_policy, (os.SCHED_OTHER, 0))
        compiler.promotions = NEVER
        after = await compiler.run(_policy)
        return [quick, at_19, at_0, after]

    try:
        quick, at_19, at_0, after = asyncio.run(main())
    finally:
        compiler.shutdown()
    assert quick[0] == os.SCHED_IDLE
    assert at_19 == (os.SCHED_OTHER, 19)
    if PRIVILEGED:
        assert at_0 == (os.SCHED_OTHER, 0)
    else:  # EPERM suppressed: it stays at nice 19
        assert at_0 == (os.SCHED_OTHER, 19)
    assert after[0] == os.SCHED_IDLE


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
    compiler = GrammarCompiler(promotions=AT_ONCE)
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
    compiler = GrammarCompiler(promotions=AT_ONCE, max_abandoned=1)
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
    compiler = GrammarCompiler(promotions=NEVER, max_pending=2)
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
    compiler = GrammarCompiler(promotions=NEVER)

    def slow() -> str:
        time.sleep(0.3)
        return "done"

    try:
        assert asyncio.run(compiler.run(slow)) == "done"
        assert compiler.num_abandoned == 0
    finally:
        compiler.shutdown()
