"""Per-request priority (lower first) and queue deadlines (a request never scheduled by
its deadline is finished with "queue_timeout")."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import Request, SamplingParams

from .scheduler_harness import Harness, assert_outputs_match_reference, make_config, prompt


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_a_lower_priority_value_is_admitted_first(policy):
    h = Harness(make_config(scheduling_policy=policy, max_num_seqs=1))
    h.add("busy", prompt(0, 8), max_tokens=3)
    h.step()
    h.add("later", prompt(1, 8), max_tokens=2, priority=5)
    h.add("urgent", prompt(2, 8), max_tokens=2, priority=-1)
    h.add("normal", prompt(3, 8), max_tokens=2)
    order = []
    while h.sched.has_unfinished_requests():
        out = h.step()
        order += [s.request_id for s in out.scheduled if s.num_computed_tokens == 0]
    assert order == ["urgent", "normal", "later"]
    assert_outputs_match_reference(h)


def test_preemption_takes_the_least_important_request_first():
    # 6 blocks of 4 tokens: three requests of 8 prompt tokens grow until one must go.
    h = Harness(make_config(num_blocks=6, block_size=4, max_num_batched_tokens=64))
    h.add("important", prompt(0, 8), max_tokens=12, priority=-5)
    h.add("spare", prompt(1, 8), max_tokens=12, priority=9)
    h.add("normal", prompt(2, 8), max_tokens=12)
    preempted = []
    while h.sched.has_unfinished_requests():
        preempted += sorted(h.step().preempted_ids)
    assert preempted and preempted[0] == "spare"
    assert "important" not in preempted
    assert_outputs_match_reference(h)


def test_a_request_still_waiting_at_its_deadline_times_out_and_holds_nothing():
    h = Harness(make_config(max_num_seqs=1))
    h.add("busy", prompt(0, 8), max_tokens=6)
    h.add("impatient", prompt(1, 30), max_tokens=2, queue_timeout=2.5)
    h.add("patient", prompt(2, 8), max_tokens=2)
    timed_out = []
    while h.sched.has_unfinished_requests():
        now = h.now
        timed_out += [(r.request_id, now) for r in h.step().timed_out]
    assert timed_out == [("impatient", 3.0)]  # the first step at or past 0 + 2.5
    assert h.requests["impatient"].finish_reason == "queue_timeout"
    assert h.requests["patient"].finish_reason == "length"
    h.check_all_free()
    assert_outputs_match_reference(h)


def test_a_deadline_does_not_cut_a_request_that_has_started():
    # A 60-token prompt over a 16-token budget is prefilled over four steps, and its
    # deadline passes in the middle: it began, so it runs to its end.
    h = Harness(make_config(max_num_batched_tokens=16))
    h.add("long", prompt(4, 60), max_tokens=3, queue_timeout=1.5)
    h.run()
    assert h.requests["long"].finish_reason == "length"
    assert_outputs_match_reference(h)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_a_non_positive_queue_timeout_is_refused(bad):
    with pytest.raises(ValueError, match="queue_timeout"):
        Request("r", [1, 2], SamplingParams(), queue_timeout=bad)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_priorities_and_deadlines_keep_every_invariant(data):
    """Random traffic with priorities and deadlines under both policies: outputs equal the
    request run alone, time-outs only hit requests that never ran (the harness checks),
    every block comes back, and no admission passes over a waiting request of a lower
    priority value."""
    cfg = make_config(
        scheduling_policy=data.draw(st.sampled_from(["fcfs", "lpm"])),
        block_size=4,
        num_blocks=data.draw(st.integers(8, 40)),
        max_num_seqs=data.draw(st.integers(1, 4)),
        max_num_batched_tokens=data.draw(st.integers(4, 32)),
        max_model_len=64,
    )
    h = Harness(cfg)
    index = 0
    for _ in range(data.draw(st.integers(1, 25))):
        for _ in range(data.draw(st.integers(0, 3))):
            h.add(
                f"r{index}",
                prompt(index % 5, data.draw(st.integers(1, 24))),
                max_tokens=data.draw(st.integers(1, 8)),
                priority=data.draw(st.integers(-2, 2)),
                queue_timeout=data.draw(st.sampled_from([None, 1.0, 3.0])),
            )
            index += 1
        waiting = list(h.sched.waiting)
        out = h.step()
        admitted = {s.request_id for s in out.scheduled if s.request in waiting}
        if admitted:
            worst = max(h.requests[i].priority for i in admitted)
            left = [r for r in waiting if r.request_id not in admitted and not r.is_finished]
            assert all(r.priority >= worst for r in left), (worst, left)
    h.run()
    assert_outputs_match_reference(h)
