"""Cache-aware admission (`scheduling_policy="lpm"`): longest cached prefix first, one
prefill per uncached shared prefix, the age bound, and outputs unchanged."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import SchedulerConfig

from .scheduler_harness import Harness, assert_outputs_match_reference, make_config, prompt


def admitted_ids(h: Harness, out) -> list[str]:
    """The requests a step admitted from `waiting`, in admission order."""
    return [item.request_id for item in out.scheduled if item.request_id in h.admitted_now]


def step(h: Harness):
    waiting_before = {r.request_id for r in h.sched.waiting}
    out = h.step()
    h.admitted_now = waiting_before - {r.request_id for r in h.sched.waiting}
    return out


def warm(h: Harness, request_id: str, tokens: list[int]) -> None:
    """Run one request to its end so its prompt's blocks stay cached."""
    h.add(request_id, tokens, max_tokens=1)
    while h.sched.has_unfinished_requests():
        h.step()


@pytest.mark.parametrize("policy, first", [("fcfs", "cold"), ("lpm", "hot")])
def test_the_request_whose_prefix_is_cached_goes_first_under_lpm(policy, first):
    h = Harness(make_config(scheduling_policy=policy, max_num_batched_tokens=40, block_size=4))
    shared = prompt(1, 32)
    warm(h, "w", shared)
    h.add("cold", prompt(2, 36), max_tokens=2)
    h.add("hot", shared + prompt(3, 4), max_tokens=2)
    out = step(h)
    assert admitted_ids(h, out)[0] == first
    if policy == "lpm":
        # The hot request costs 4 tokens (its prefix is cached); the cold one's 36 need
        # more than the 36 left of the budget, so it gets the rest as a first chunk.
        assert [(s.request_id, s.num_computed_tokens, len(s.token_ids)) for s in out.scheduled] == [
            ("hot", 32, 4),
            ("cold", 0, 36),
        ]
    h.run()
    assert_outputs_match_reference(h)


def prefill_tokens(h: Harness) -> int:
    """Tokens computed for prompts over the whole run (decode tokens excluded)."""
    total = 0
    for out in h.outputs:
        for item in out.scheduled:
            request = h.requests[item.request_id]
            end = item.num_computed_tokens + len(item.token_ids)
            total += max(0, min(end, request.num_prompt_tokens) - item.num_computed_tokens)
    return total


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
@pytest.mark.parametrize("budget", [32, 40, 200])
def test_requests_arriving_together_for_a_new_prefix_compute_it_once(policy, budget):
    # A 96-token prefix, over the budget (prefilled in chunks) or within it. The first
    # request's blocks are cached as they are allocated and its unfinished prefill takes
    # the whole budget, so the others hit all of it (SGLang's in-batch dedup, for free).
    h = Harness(make_config(scheduling_policy=policy, max_num_batched_tokens=budget, block_size=4))
    shared = prompt(7, 96)
    for i in range(4):
        h.add(f"r{i}", shared + prompt(10 + i, 4), max_tokens=3)
    h.run()
    assert_outputs_match_reference(h)
    assert prefill_tokens(h) == 96 + 4 * 4
    assert [h.requests[f"r{i}"].num_cached_tokens for i in range(4)] == [0, 96, 96, 96]


@pytest.mark.parametrize("age_bound", [3.0, None])
def test_a_request_past_the_age_bound_is_admitted_before_cache_hits(age_bound):
    # Two cache-hot requests arrive every step and would always outrank the cold one;
    # once it has waited age_bound_s (steps of the harness clock) nobody younger goes
    # before it. Without a bound (None: longer than the run) it starves.
    cfg = make_config(
        scheduling_policy="lpm",
        age_bound_s=age_bound or 1e6,
        max_num_seqs=2,
        max_num_batched_tokens=64,
    )
    h = Harness(cfg)
    shared = prompt(1, 40)
    warm(h, "w", shared)
    h.add("cold", prompt(2, 40), max_tokens=1)
    cold = h.requests["cold"]
    admitted_at = None
    for i in range(12):
        h.add(f"hot{i}", shared + prompt(100 + i, 4), max_tokens=4)
        h.add(f"hot{i}b", shared + prompt(200 + i, 4), max_tokens=4)
        now = h.now
        out = step(h)
        admitted = admitted_ids(h, out)
        if "cold" in admitted:
            admitted_at = now
            assert admitted[0] == "cold"
            break
        if admitted and age_bound is not None:
            assert now - cold.arrival_time <= age_bound, f"{admitted} overtook it at {now}"
    if age_bound is None:
        assert admitted_at is None
        return
    assert admitted_at is not None and admitted_at - cold.arrival_time > age_bound
    h.run()
    assert_outputs_match_reference(h)


def test_lpm_without_prefix_caching_is_fcfs():
    orders = {}
    for policy in ("fcfs", "lpm"):
        h = Harness(make_config(scheduling_policy=policy, enable_prefix_caching=False))
        for i in range(6):
            h.add(f"r{i}", prompt(i % 2, 30 + i), max_tokens=2)
        h.run()
        orders[policy] = [[s.request_id for s in out.scheduled] for out in h.outputs]
    assert orders["lpm"] == orders["fcfs"]


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "5"])
def test_a_bad_age_bound_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="age_bound_s"):
        SchedulerConfig(age_bound_s=bad)


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="sjf")


PREFIXES = [prompt(500 + i, 24) for i in range(3)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_lpm_keeps_outputs_and_lets_no_unique_prompt_be_overtaken_past_the_age_bound(data):
    """Random arrivals of shared-prefix and unique prompts: every output equals the
    request run alone, every block comes back, and a request whose prompt shares no
    block with another (so it never waits on someone's prefill) is never overtaken by a
    younger one once it is older than the age bound."""
    age_bound = data.draw(st.sampled_from([0.0, 2.0, 5.0]))
    cfg = make_config(
        scheduling_policy="lpm",
        age_bound_s=age_bound,
        block_size=4,
        num_blocks=data.draw(st.integers(24, 80)),
        max_num_seqs=data.draw(st.integers(1, 5)),
        max_num_batched_tokens=data.draw(st.integers(4, 48)),
        max_model_len=96,
    )
    h = Harness(cfg)
    unique: set[str] = set()
    index = 0
    for _ in range(data.draw(st.integers(1, 30))):
        for _ in range(data.draw(st.integers(0, 3))):
            rid = f"r{index}"
            if data.draw(st.booleans()):
                tokens = data.draw(st.sampled_from(PREFIXES)) + prompt(index, 3)
            else:
                tokens = [90 + index % 7] + prompt(10_000 + index, data.draw(st.integers(1, 30)))
                unique.add(rid)
            h.add(rid, tokens, max_tokens=data.draw(st.integers(1, 8)))
            index += 1
        now = h.now
        waiting_before = list(h.sched.waiting)
        out = step(h)
        admitted = [h.requests[i] for i in admitted_ids(h, out)]
        for late in waiting_before:
            if late.request_id in h.admitted_now or late.request_id not in unique:
                continue
            if late.arrival_time < now - age_bound:
                younger = [r.request_id for r in admitted if r.arrival_time > late.arrival_time]
                assert not younger, f"{younger} overtook {late.request_id} past its age bound"
    h.run()
    assert_outputs_match_reference(h)
