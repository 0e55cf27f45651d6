"""Tensor parallelism's step diffs: the other ranks rebuild every scheduled request's block
table from `WorkerStep`s alone (a new request's table once, then the blocks it gains),
under random traffic with preemption, aborts and prefix hits; and a step's message does not
grow with the requests' lengths."""

from __future__ import annotations

import contextlib
import pickle

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.tp_worker import BlockTables, worker_step
from tests.scheduler.scheduler_harness import Harness, make_config, prompt

PREFIX = prompt(7, 20)


def mirrored(h: Harness) -> BlockTables:
    """Every schedule() of `h` checked against a rank's rebuilt tables (through pickle,
    as torch.distributed sends it)."""
    tables = BlockTables()
    schedule = h.sched.schedule

    def checked_schedule():
        out = schedule()
        step = pickle.loads(pickle.dumps(worker_step(out)))
        rebuilt = tables.apply(step)
        assert [s.block_ids for s in rebuilt.scheduled] == [s.block_ids for s in out.scheduled]
        for got, want in zip(rebuilt.scheduled, out.scheduled, strict=True):
            assert got.request is None
            assert (got.request_id, got.token_ids, got.num_computed_tokens, got.sample) == (
                want.request_id, want.token_ids, want.num_computed_tokens, want.sample,
            )  # fmt: skip
        assert rebuilt.num_batched_tokens == out.num_batched_tokens
        return out

    h.sched.schedule = checked_schedule
    return tables


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_ranks_rebuild_every_block_table_from_the_diffs(data):
    cfg = make_config(
        block_size=data.draw(st.integers(1, 4)),
        num_blocks=data.draw(st.integers(8, 24)),  # small: preemption happens
        max_num_seqs=data.draw(st.integers(1, 5)),
        max_num_batched_tokens=data.draw(st.integers(2, 16)),
        max_model_len=64,
    )
    h = Harness(cfg)
    tables = mirrored(h)
    for i in range(data.draw(st.integers(1, 12))):
        tail = prompt(i, data.draw(st.integers(1, 10)))
        prefix = PREFIX if data.draw(st.booleans()) else []
        with contextlib.suppress(ValueError):  # more than the cache holds
            h.add(f"r{i}", prefix + tail, max_tokens=data.draw(st.integers(1, 12)))
        live = sorted(h.sched.requests)
        if live and data.draw(st.integers(0, 5)) == 0:
            h.sched.abort_requests([data.draw(st.sampled_from(live))])
        h.step()
    h.run()
    h.step()  # the last finishes reach the ranks
    assert len(tables) == 0  # nothing kept for requests that ended


def test_a_decode_step_message_does_not_grow_with_the_prompt():
    sizes = []
    for prompt_len in (10, 1000):
        h = Harness(make_config(block_size=16, num_blocks=512, max_num_batched_tokens=4096,
                                max_model_len=2048))  # fmt: skip
        for i in range(4):
            h.add(f"r{i}", prompt(i, prompt_len), max_tokens=8)
        h.step()  # the prefills: the whole tables go once
        out = h.sched.schedule()  # a decode step
        sizes.append(len(pickle.dumps(worker_step(out))))
        full = len(pickle.dumps(out))
    # Only the ids' own widths differ (block ids past 255 pickle in more bytes).
    assert sizes[1] <= sizes[0] + 16, sizes
    assert sizes[1] * 5 < full  # what pickling the whole SchedulerOutput sent
