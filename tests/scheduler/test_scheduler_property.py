"""Random traffic (arrivals, aborts, stop strings) under random limits: invariants every step."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import RequestStatus

from .scheduler_harness import VOCAB, Harness, assert_outputs_match_reference, make_config, prompt

PREFIXES = [prompt(1000 + i, 12) for i in range(3)]


def fits(prompt_len: int, max_tokens: int, cfg) -> bool:
    """Independent statement of what add_request must accept."""
    if prompt_len + 1 > cfg.max_model_len:
        return False
    kv_tokens = min(prompt_len + max_tokens, cfg.max_model_len) - 1
    return -(-kv_tokens // cfg.block_size) <= cfg.num_blocks


def draw_request(data, index: int) -> tuple[list[int], dict]:
    prefix = data.draw(st.sampled_from([[], *PREFIXES]))
    prefix = prefix[: data.draw(st.integers(0, len(prefix)))]
    tail = prompt(index, data.draw(st.integers(0 if prefix else 1, 20)))
    max_tokens = data.draw(st.integers(1, 20))
    kwargs = dict(
        max_tokens=max_tokens,
        min_tokens=data.draw(st.integers(0, max_tokens)),
        eos_token_ids=data.draw(st.frozensets(st.integers(0, VOCAB - 1), max_size=2)),
        cache_salt=data.draw(st.sampled_from([None, None, "t1"])),
        ignore_eos=data.draw(st.booleans()),
    )
    return prefix + tail, kwargs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_traffic_keeps_every_invariant(data):
    max_num_seqs = data.draw(st.integers(1, 6))
    cfg = make_config(
        block_size=data.draw(st.integers(1, 6)),
        num_blocks=data.draw(st.integers(2, 30)),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=data.draw(st.integers(1, 24)),
        max_model_len=data.draw(st.integers(2, 60)),
        enable_prefix_caching=data.draw(st.booleans()),
        prefix_cache_hash=data.draw(st.sampled_from(["builtin", "sha256"])),
        scheduling_policy=data.draw(st.sampled_from(["fcfs", "lpm"])),
        age_bound_s=data.draw(st.sampled_from([0.0, 3.0])),
    )
    h = Harness(cfg)
    index = 0
    for _ in range(data.draw(st.integers(1, 40))):
        for _ in range(data.draw(st.integers(0, 2))):
            tokens, kwargs = draw_request(data, index)
            rid = f"r{index}"
            index += 1
            try:
                h.add(rid, tokens, **kwargs)
                assert fits(len(tokens), kwargs["max_tokens"], cfg)
            except ValueError:
                assert not fits(len(tokens), kwargs["max_tokens"], cfg)
        live = sorted(h.sched.requests)
        if live and data.draw(st.integers(0, 9)) == 0:
            h.sched.abort_requests([data.draw(st.sampled_from(live))])
        if live and data.draw(st.integers(0, 19)) == 0:
            victim = data.draw(st.sampled_from(live))
            if h.requests[victim].status is RequestStatus.RUNNING:
                h.sched.finish_requests([victim], RequestStatus.FINISHED_STOPPED)
                h.requests.pop(victim)  # stopped by a "stop string": no reference to match
        h.check_state()
        h.step()
    h.run()
    assert_outputs_match_reference(h)
