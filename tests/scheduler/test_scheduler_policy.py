"""Continuous batching, token budget, chunked prefill, preemption, prefix hits, FCFS."""

import random

import pytest

from scheduler import RequestStatus

from .scheduler_harness import Harness, assert_outputs_match_reference, make_config, prompt


def shape(out) -> list[tuple[str, int, int, bool]]:
    """(id, position of the first token, number of tokens, sample) per scheduled request."""
    return [
        (s.request_id, s.num_computed_tokens, len(s.token_ids), s.sample) for s in out.scheduled
    ]


def test_new_requests_join_while_others_decode():
    h = Harness(make_config())
    h.add("a", prompt(1, 10), max_tokens=20)
    assert shape(h.step()) == [("a", 0, 10, True)]
    assert shape(h.step()) == [("a", 10, 1, True)]
    h.add("b", prompt(2, 12), max_tokens=5)
    # b's whole prefill runs in the same step as a's decode.
    assert shape(h.step()) == [("a", 11, 1, True), ("b", 0, 12, True)]
    assert shape(h.step()) == [("a", 12, 1, True), ("b", 12, 1, True)]
    h.run()
    assert_outputs_match_reference(h)


def test_token_budget_and_max_num_seqs_are_never_exceeded():
    cfg = make_config(max_num_seqs=3, max_num_batched_tokens=10)
    h = Harness(cfg)
    rng = random.Random(0)
    for i in range(10):
        h.add(f"r{i}", prompt(i, rng.randint(1, 30)), max_tokens=rng.randint(1, 12))
    h.run()  # the harness asserts both limits after every schedule()
    assert max(len(out.scheduled) for out in h.outputs) == cfg.max_num_seqs
    assert max(out.num_batched_tokens for out in h.outputs) == cfg.max_num_batched_tokens
    assert_outputs_match_reference(h)


def test_long_prompt_is_prefilled_in_chunks_and_sampled_once_at_the_end():
    h = Harness(make_config(max_num_seqs=4, max_num_batched_tokens=16))
    h.add("long", prompt(3, 50), max_tokens=3)
    steps = [shape(h.step()) for _ in range(6)]
    assert steps == [
        [("long", 0, 16, False)],
        [("long", 16, 16, False)],
        [("long", 32, 16, False)],
        [("long", 48, 2, True)],
        [("long", 50, 1, True)],
        [("long", 51, 1, True)],
    ]
    assert not h.sched.has_unfinished_requests()
    assert_outputs_match_reference(h)
    h.check_all_free()


def test_prefill_chunk_takes_the_budget_left_after_decodes():
    h = Harness(make_config(max_num_seqs=4, max_num_batched_tokens=16))
    h.add("a", prompt(4, 5), max_tokens=10)
    h.step()
    h.add("b", prompt(5, 40), max_tokens=2)
    assert shape(h.step()) == [("a", 5, 1, True), ("b", 0, 15, False)]
    assert shape(h.step()) == [("a", 6, 1, True), ("b", 15, 15, False)]
    assert shape(h.step()) == [("a", 7, 1, True), ("b", 30, 10, True)]
    h.run()
    assert_outputs_match_reference(h)


@pytest.mark.parametrize("caching", [True, False])
def test_a_tiny_pool_preempts_yet_yields_the_outputs_of_a_large_pool(caching):
    def run(num_blocks: int) -> Harness:
        h = Harness(make_config(num_blocks=num_blocks, enable_prefix_caching=caching))
        for i in range(6):
            # Half the prompts share 8 tokens so that recomputation can hit the cache.
            shared = prompt(100, 8) if i % 2 else []
            h.add(f"r{i}", shared + prompt(i, 13 + i), max_tokens=30)
        h.run()
        return h

    small, large = run(17), run(400)
    assert small.sched.num_preemptions > 0
    assert large.sched.num_preemptions == 0
    assert any(out.preempted_ids for out in small.outputs)
    assert sum(r.num_preemptions for r in small.requests.values()) == small.sched.num_preemptions
    for rid, request in small.requests.items():
        assert request.output_token_ids == large.requests[rid].output_token_ids
    assert_outputs_match_reference(small)


def test_preemption_evicts_the_most_recently_admitted_request():
    h = Harness(make_config(num_blocks=6))
    for rid, seed in (("a", 11), ("b", 12), ("c", 13)):
        h.add(rid, prompt(seed, 7), max_tokens=10)
    assert [s.request_id for s in h.step().scheduled] == ["a", "b", "c"]  # 2 blocks each
    h.add("d", prompt(14, 7), max_tokens=10)
    h.step()  # 8 tokens each still fit in 2 blocks; no room for d
    out = h.step()  # a and b each need a third block: c must go
    assert out.preempted_ids == {"c"}
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    c = h.requests["c"]
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and h.sched.num_preemptions == 1
    assert [r.request_id for r in h.sched.waiting] == ["c", "d"]  # back at the head
    assert len(c.output_token_ids) == 2  # kept: it will be recomputed, not re-sampled
    h.run()
    assert_outputs_match_reference(h)


def test_preempted_request_resumes_by_recomputing_all_its_tokens():
    h = Harness(make_config(num_blocks=6, enable_prefix_caching=False))
    for rid, seed in (("a", 11), ("b", 12), ("c", 13)):
        h.add(rid, prompt(seed, 7), max_tokens=10)
    for _ in range(3):
        h.step()
    c = h.requests["c"]
    assert c.status is RequestStatus.PREEMPTED
    num_tokens = len(c.all_token_ids)
    while c.status is not RequestStatus.RUNNING:
        out = h.step()
    [item] = [s for s in out.scheduled if s.request_id == "c"]
    # Prompt + outputs recomputed in one go; the next token is sampled, none re-sampled.
    assert (item.num_computed_tokens, len(item.token_ids), item.sample) == (0, num_tokens, True)
    assert len(c.output_token_ids) == num_tokens - 7 + 1
    h.run()
    assert_outputs_match_reference(h)


def test_the_last_running_request_preempts_itself_and_the_step_stops():
    h = Harness(make_config(num_blocks=5))
    h.add("a", prompt(21, 8), max_tokens=10)  # 2 full blocks
    h.add("b", prompt(22, 6), max_tokens=10)  # 2 blocks, 1 left free
    h.step()
    h.step()  # a takes the last free block for its 9th token
    h.step()
    out = h.step()  # b's 9th token needs a block; b itself is the newest running request
    assert out.preempted_ids == {"b"}
    assert [s.request_id for s in out.scheduled] == ["a"]
    assert h.sched.waiting[0].request_id == "b"
    h.run()
    assert_outputs_match_reference(h)


def test_admission_is_first_come_first_served():
    h = Harness(make_config(num_blocks=8))
    h.add("a", prompt(31, 16), max_tokens=8)  # 4 blocks, growing to 6
    h.step()
    h.add("b", prompt(32, 20), max_tokens=8)  # needs 5 blocks, only 3 will be free
    h.add("c", prompt(33, 3), max_tokens=2)  # would fit, but must not overtake b
    out = h.step()
    assert [s.request_id for s in out.scheduled] == ["a"]
    assert [r.request_id for r in h.sched.waiting] == ["b", "c"]
    h.run()
    assert_outputs_match_reference(h)
    # b ran before c started.
    first_step = {
        rid: next(i for i, o in enumerate(h.outputs) if rid in {s.request_id for s in o.scheduled})
        for rid in ("b", "c")
    }
    assert first_step["b"] <= first_step["c"]


def test_a_shared_prefix_is_served_from_the_cache():
    h = Harness(make_config())
    shared = prompt(41, 12)  # 3 full blocks of 4
    a = h.add("a", shared + prompt(42, 5), max_tokens=4)
    h.step()
    b = h.add("b", shared + prompt(43, 6), max_tokens=4)
    out = h.step()
    [item] = [s for s in out.scheduled if s.request_id == "b"]
    assert (item.num_computed_tokens, len(item.token_ids)) == (12, 6)
    assert item.block_ids[:3] == h.mgr.get_block_ids("a")[:3]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 12
    assert h.mgr.stats.hits == 12
    # Another tenant's salt makes the same prompt miss.
    c = h.add("c", shared + prompt(43, 6), cache_salt="tenant-b", max_tokens=4)
    h.step()
    assert c.num_cached_tokens == 0
    h.run()
    assert_outputs_match_reference(h)


def test_no_prefix_hits_when_caching_is_disabled():
    h = Harness(make_config(enable_prefix_caching=False))
    shared = prompt(41, 12)
    h.add("a", shared + [1], max_tokens=2)
    h.step()
    b = h.add("b", shared + [2], max_tokens=2)
    h.step()
    assert b.num_cached_tokens == 0
    h.run()
    assert_outputs_match_reference(h)


def test_a_resumed_request_recomputes_from_its_surviving_cached_blocks():
    h = Harness(make_config(num_blocks=5))
    h.add("a", prompt(51, 8), max_tokens=5)  # 2 blocks, needs a 3rd at its 9th token
    c = h.add("c", prompt(52, 12), max_tokens=3)  # 3 full blocks: the pool is full
    h.step()
    out = h.step()
    assert out.preempted_ids == {"c"}
    # a took c's tail block (freed first); c's first two blocks are still cached.
    while c.status is not RequestStatus.RUNNING:
        out = h.step()
    [item] = [s for s in out.scheduled if s.request_id == "c"]
    assert (item.num_computed_tokens, len(item.token_ids), item.sample) == (8, 5, True)
    assert c.num_cached_tokens == 0  # counted at first admission only
    h.run()
    assert_outputs_match_reference(h)
