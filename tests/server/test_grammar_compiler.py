"""The grammar compile thread runs at idle priority, and as an ordinary nice-19 thread
while a compile has waited longer than its promotion delay (so a machine kept busy by
other processes cannot starve structured requests forever)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from server.grammar_compiler import GrammarCompiler

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling")


def _policy() -> tuple[int, int]:
    """The calling thread's scheduling policy and nice value."""
    return os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)


def test_compiles_run_idle_and_a_long_wait_promotes_until_none_is_left():
    # The quick compiles get a delay no busy machine reaches: an idle thread waits for a
    # free core, and one that waited past the delay is promoted, as it should be.
    compiler = GrammarCompiler(promote_after_s=3600)

    def slow() -> tuple[int, int]:
        time.sleep(0.3)  # past the promotion delay
        return _policy()

    async def main() -> list[tuple[int, int]]:
        quick = await compiler.run(_policy)
        compiler.promote_after_s = 0.05
        during = await compiler.run(slow)
        compiler.promote_after_s = 3600
        after = await compiler.run(_policy)
        return [quick, during, after]

    try:
        quick, during, after = asyncio.run(main())
    finally:
        compiler.shutdown()
    assert quick[0] == os.SCHED_IDLE
    assert during == (os.SCHED_OTHER, 19)
    assert after[0] == os.SCHED_IDLE
