"""The state group (kv_cache/state_group.py): a live slot per running request, snapshots at
block boundaries cached once written, a prefix hit that resumes from the last snapshot
inside it, and every slot back when a request ends, however it ends."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kv_cache.groups import KVCacheGroup
from kv_cache.host_tier import HEADER_BYTES, HostTier
from kv_cache.hybrid import HybridKVCacheManager, kv_cache_manager_for
from kv_cache.state_group import ZERO, StateGroup, StateStep
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig

BS = 4


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    extra_keys: tuple = ()
    output: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.all_token_ids)


def manager(
    num_slots: int = 8, interval: int = 2, num_blocks: int = 64, **tiers: HostTier
) -> HybridKVCacheManager:
    mgr = kv_cache_manager_for(
        (KVCacheGroup(None, (3,)),),
        num_blocks,
        BS,
        hash_algo="sha256" if tiers else "builtin",
        state=StateGroup(layers=(0, 1, 2), num_slots=num_slots, snapshot_interval=interval),
        **tiers,
    )
    assert isinstance(mgr, HybridKVCacheManager)
    return mgr


def admit(mgr: HybridKVCacheManager, req: Req, budget: int = 10_000) -> tuple[int, StateStep]:
    """A scheduler's admission: lookup, allocate, advance; the hit and the step."""
    hits, num_hit = mgr.get_computed_blocks(req)
    num_new = min(len(req.all_token_ids) - num_hit, budget)
    assert mgr.allocate_slots(req, num_new, hits) is not None
    req.num_computed_tokens = num_hit + num_new
    step = mgr.take_state_step(req.request_id)
    assert step is not None
    return num_hit, step


def decode(mgr: HybridKVCacheManager, req: Req, token: int) -> StateStep:
    """The step after a sampled token: its KV and its state."""
    req.all_token_ids.append(token)
    assert mgr.allocate_slots(req, 1) is not None
    req.num_computed_tokens += 1
    step = mgr.take_state_step(req.request_id)
    assert step is not None
    return step


def test_a_new_request_zeroes_its_slot_and_snapshots_each_interval_and_its_prompt_end():
    mgr = manager()
    req = Req("a", list(range(30)))  # 7 full blocks and 2 tokens
    hit, step = admit(mgr, req)
    assert hit == 0 and step.source == ZERO
    # Every 2 blocks (8 tokens), and the last boundary before the prompt's last token (28).
    assert [end for end, _ in step.saves] == [8, 16, 24, 28]
    assert step.slot not in {slot for _, slot in step.saves}
    assert len({slot for _, slot in step.saves}) == 4
    mgr.check_invariants()


def test_a_repeat_resumes_from_the_prompt_end_snapshot_once_it_was_written():
    mgr = manager()
    first = Req("a", list(range(30)))
    _, step = admit(mgr, first)
    # Not before the step that writes it has run: a lookup in the same step misses.
    assert mgr.get_computed_blocks(Req("early", list(range(30))))[1] == 0
    mgr.free("early")
    decode(mgr, first, 99)  # the first request's next step: its snapshots are written
    again = Req("b", list(range(30)))
    hit, step_b = admit(mgr, again)
    assert hit == 28
    assert step_b.source == dict((e, s) for e, s in step.saves)[28]
    assert step_b.saves == ()  # nothing new to snapshot in the 2 tokens left
    # The copy's source is held until that step has run, then free (cached) again.
    assert mgr.state.pool.blocks[step_b.source].ref_cnt == 1
    decode(mgr, again, 5)
    assert mgr.state.pool.blocks[step_b.source].ref_cnt == 0
    mgr.check_invariants()


def test_a_longer_prompt_resumes_from_the_last_snapshot_inside_its_shared_prefix():
    mgr = manager()
    first = Req("a", list(range(30)))
    admit(mgr, first)
    mgr.free(first)
    # Shares 26 tokens: blocks 0..5 (24 tokens) whole, so the snapshot at 24 serves it.
    other = Req("b", list(range(26)) + [500 + i for i in range(20)])
    hit, step = admit(mgr, other)
    assert hit == 24 and step.source != ZERO
    assert [end for end, _ in step.saves] == [32, 40, 44]
    mgr.check_invariants()


def test_the_hit_is_the_longest_prefix_every_group_serves():
    mgr = manager()
    first = Req("a", list(range(30)))
    admit(mgr, first)
    mgr.free(first)
    # Evict the KV blocks past block 2 (the snapshots survive): the hit shrinks to the
    # last snapshot within the KV hit, 8 tokens.
    kv = mgr.groups[0]
    probe = Req("probe", list(range(30)))
    hashes = kv._lookup(probe)[0].block_hashes
    for h in hashes[3:]:
        mgr.block_pool.uncache(mgr.block_pool.cached_hash_to_block[h])
    kv.free(probe)
    hit, step = admit(mgr, Req("b", list(range(30))))
    assert hit == 8 and step.source != ZERO
    mgr.check_invariants()


def test_state_memory_does_not_grow_with_the_sequence():
    mgr = manager(num_slots=6, interval=2, num_blocks=200)
    req = Req("a", list(range(10)))
    admit(mgr, req)
    held = []
    for token in range(400):
        decode(mgr, req, token)
        held.append(mgr.state.num_slots_in_use)
    # One live slot, plus at most the snapshot a step is writing; the KV blocks grow.
    assert max(held) == 2 and min(held) == 1
    assert mgr.groups[0].num_blocks_in_use >= 410 // BS
    mgr.check_invariants()


def test_snapshots_take_only_the_slots_left_and_never_block_a_request():
    mgr = manager(num_slots=2, interval=1)
    req = Req("a", list(range(40)))  # 9 boundaries wanted
    _, step = admit(mgr, req)
    assert [end for end, _ in step.saves] == [40]  # one slot left: the longest kept
    # A second request needs a live slot; the snapshot is free once its step ran.
    other = Req("b", [7] * 9)
    hits, _ = mgr.get_computed_blocks(other)
    assert mgr.allocate_slots(other, 9, hits) is None  # both slots held this step
    mgr.free(other)
    decode(mgr, req, 1)
    _, step_b = admit(mgr, other)
    assert step_b.source == ZERO
    mgr.check_invariants()


def test_every_slot_comes_back_when_requests_end_however_they_end():
    mgr = manager(num_slots=16)
    reqs = [Req(str(i), [i] * 30) for i in range(3)]
    for req in reqs:
        admit(mgr, req)
    decode(mgr, reqs[0], 1)
    mgr.uncache_unwritten("1", 0)  # request 1's step failed: its snapshots hold nothing
    for req in reqs:
        mgr.free(req)
    assert mgr.state.num_slots_in_use == 0
    counts = mgr.block_counts().states
    assert counts is not None and counts.in_use == 0 and counts.total == 16
    # Request 0's and 2's snapshots are cached; request 1's are not.
    assert mgr.get_computed_blocks(Req("r0", [0] * 30))[1] == 28
    assert mgr.get_computed_blocks(Req("r1", [1] * 30))[1] == 0
    assert mgr.get_computed_blocks(Req("r2", [2] * 30))[1] == 28
    for rid in ("r0", "r1", "r2"):
        mgr.free(rid)
    mgr.check_invariants()
    assert mgr.reset_prefix_cache()
    assert mgr.get_computed_blocks(Req("r0", [0] * 30))[1] == 0


def test_without_prefix_caching_no_snapshot_is_taken():
    mgr = kv_cache_manager_for(
        (KVCacheGroup(None, (1,)),), 64, BS, enable_caching=False,
        state=StateGroup(layers=(0,), num_slots=4),
    )  # fmt: skip
    hit, step = admit(mgr, Req("a", list(range(100))))
    assert hit == 0 and step.source == ZERO and step.saves == ()


def test_the_scheduler_hands_each_step_its_state_instructions():
    config = SchedulerConfig(
        max_num_batched_tokens=16, block_size=BS, num_blocks=64,
        kv_cache_groups=(KVCacheGroup(None, (1,)),),
        state_group=StateGroup(layers=(0,), num_slots=4, snapshot_interval=2),
    )  # fmt: skip
    sched = Scheduler(config)
    sched.add_request(Request("a", list(range(20)), SamplingParams(max_tokens=4)))
    first = sched.schedule().scheduled[0]  # a 16-token chunk
    assert first.state.source == ZERO and [e for e, _ in first.state.saves] == [8, 16]
    second = sched.schedule().scheduled[0]  # the last 4 tokens; none before 19 is new
    assert second.state.slot == first.state.slot and second.state.source is None
    assert second.state.saves == ()


def test_a_speculative_step_keeps_the_state_its_accepted_drafts_end_at():
    mgr = manager(num_slots=8, interval=100)
    req = Req("a", list(range(10)))
    admit(mgr, req)
    req.all_token_ids.append(50)  # sampled; 10 tokens computed, and now 3 drafts after it
    assert mgr.allocate_slots(req, 4) is not None
    step = mgr.take_state_step("a")
    rollback = dict(step.saves)
    assert sorted(rollback) == [11, 12, 13]  # after the known token, after drafts 1 and 2
    # One draft kept, one token of its own: 12 tokens have their state.
    req.all_token_ids += [51, 52]
    req.num_computed_tokens = 12
    mgr.trim(req)
    assert mgr.state.num_slots_in_use == 2  # the live slot and the state after 12 tokens
    next_step = decode(mgr, req, 53)
    assert next_step.source == rollback[12]
    decode(mgr, req, 54)
    assert mgr.state.num_slots_in_use == 1
    # Every draft kept: the live slot is right as it is.
    req.all_token_ids.append(55)
    assert mgr.allocate_slots(req, 3) is not None
    mgr.take_state_step("a")
    req.all_token_ids += [56, 57]
    req.num_computed_tokens = len(req.all_token_ids) - 1
    mgr.trim(req)
    assert decode(mgr, req, 58).source is None
    assert mgr.state.num_slots_in_use == 1
    mgr.check_invariants()


def test_a_prefix_two_requests_share_is_snapshotted_where_it_ends():
    mgr = manager(num_slots=16, interval=100)  # no interval snapshot in reach
    shared = list(range(22))  # 5 full blocks and 2 tokens
    first = Req("a", shared + [100 + i for i in range(10)])
    admit(mgr, first)
    mgr.free(first)
    # The KV blocks hold the 20 shared tokens' blocks; the state has no snapshot there yet,
    # so the second request computes them and snapshots their end.
    second = Req("b", shared + [200 + i for i in range(10)])
    hit, step = admit(mgr, second)
    assert hit == 0 and 20 in [end for end, _ in step.saves]
    mgr.free(second)
    third = Req("c", shared + [300 + i for i in range(10)])
    assert admit(mgr, third)[0] == 20
    mgr.check_invariants()


def test_a_request_waits_a_step_for_the_snapshot_another_is_writing():
    mgr = manager(num_slots=16, interval=2)
    first = Req("a", list(range(30)))
    admit(mgr, first)  # writes snapshots at 8, 16, 24 and 28 this step
    second = Req("b", list(range(26)) + [7, 7, 7])
    hits, _ = mgr.get_computed_blocks(second)
    assert mgr.allocate_slots(second, 29, hits) is None  # not now: the snapshot at 24 is coming
    decode(mgr, first, 1)  # the first request's step ran: its snapshots are published
    hit, step = admit(mgr, second)
    assert hit == 24 and step.source != ZERO
    # A request sharing nothing with what is being written never waits.
    decode(mgr, second, 1)
    other = Req("c", [9] * 30)
    assert admit(mgr, other)[0] == 0
    mgr.check_invariants()


def tiers(tmp_path, entries: int = 32) -> dict[str, HostTier]:
    """A KV tier and a state tier, each of `entries` entries (8 and 64 fake bytes)."""
    return {
        "tier": HostTier(tmp_path / "kv.bin", HEADER_BYTES + entries * (8 + 36), 8, "kv"),
        "state_tier": HostTier(tmp_path / "st.bin", HEADER_BYTES + entries * (64 + 36), 64, "st"),
    }


def test_an_evicted_snapshot_goes_to_the_state_tier_and_a_hit_brings_it_back(tmp_path):
    mgr = manager(num_slots=2, interval=8, **tiers(tmp_path))
    first = Req("a", list(range(30)))
    _, step = admit(mgr, first)
    (saved,) = [slot for end, slot in step.saves if end == 28]  # the prompt end's only
    decode(mgr, first, 99)  # written: cached
    key = mgr.state._state(first).hashes[6]
    mgr.free(first)
    assert mgr.take_state_tier_moves() == ([], {})
    churn = Req("churn", [700 + i for i in range(30)])  # takes both slots: evicts it
    admit(mgr, churn)
    offloads, _ = mgr.take_state_tier_moves()
    assert (saved, key) in offloads
    for block_id, block_hash in offloads:  # the engine copies the slots out
        mgr.state_tier.put(block_hash, bytes([block_id]) * 64)
    mgr.free(churn)
    hit, step_b = admit(mgr, Req("b", list(range(30))))
    assert hit == 28  # KV blocks still in the pool, the snapshot back from the tier
    _, loads = mgr.take_state_tier_moves()
    assert loads == {step_b.source: bytes([saved]) * 64}  # copied in before the step
    mgr.check_invariants()


def test_a_kv_tier_needs_the_state_tier_beside_it(tmp_path):
    both = tiers(tmp_path)
    with pytest.raises(ValueError, match="state group's tier"):
        manager(tier=both["tier"])
    with pytest.raises(ValueError, match="a state tier needs"):
        manager(state_tier=both["state_tier"])
