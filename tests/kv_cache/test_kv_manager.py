from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kv_cache import AllBlocksCleared, KVCacheManager

ALGOS = ["builtin", "sha256"]


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    extra_keys: tuple = field(default_factory=tuple)


def admit(mgr: KVCacheManager, req: Req, num_new: int | None = None) -> list | None:
    """Look up and allocate a new request's prompt (or its first num_new tokens
    after the hits); advance it on success."""
    hits, num_hit_tokens = mgr.get_computed_blocks(req)
    if num_new is None:
        num_new = len(req.all_token_ids) - num_hit_tokens
    new = mgr.allocate_slots(req, num_new, hits)
    if new is not None:
        req.num_computed_tokens += num_hit_tokens + num_new
    return new


def snapshot(mgr: KVCacheManager, request_ids: list[str]) -> tuple:
    pool = mgr.block_pool
    return (
        mgr.free_block_ids(),
        {rid: mgr.get_block_ids(rid) for rid in request_ids},
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash for b in pool.blocks],
        {h: b.block_id for h, b in pool.cached_hash_to_block.items()},
        mgr.num_free_blocks,
    )


@pytest.mark.parametrize("algo", ALGOS)
def test_short_pool_returns_none_and_changes_nothing(algo: str) -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=4, hash_algo=algo)
    assert admit(mgr, Req("a", list(range(10)))) is not None  # 3 blocks
    before = snapshot(mgr, ["a", "b"])
    assert admit(mgr, Req("b", list(range(100, 105)))) is None  # needs 2, 1 free
    assert snapshot(mgr, ["a", "b"]) == before
    mgr.check_invariants()


@pytest.mark.parametrize("algo", ALGOS)
def test_free_hits_count_as_used_free_blocks(algo: str) -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=4, hash_algo=algo)
    shared = list(range(8))
    admit(mgr, Req("a", [*shared, 99]))  # blocks 0,1 cached, 2 partial
    mgr.free(Req("a", []))
    filler = Req("x", list(range(200, 212)))
    admit(mgr, filler)  # takes 3 blocks: 3 free remain, 0 and 1 among them
    assert mgr.num_free_blocks == 3

    # 13 tokens: hits 0,1 (both ref_cnt 0) + 2 new blocks = 4 free blocks used.
    b = Req("b", [*shared, 1, 2, 3, 4, 5])
    hits, _ = mgr.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and all(h.ref_cnt == 0 for h in hits)
    before = snapshot(mgr, ["b", "x"])
    assert mgr.allocate_slots(b, 5, hits) is None
    assert snapshot(mgr, ["b", "x"]) == before
    mgr.check_invariants()

    mgr.free(filler)
    assert admit(mgr, b) is not None
    assert mgr.get_block_ids("b")[:2] == (0, 1)
    mgr.check_invariants()


@pytest.mark.parametrize("algo", ALGOS)
def test_hits_in_use_need_no_free_block(algo: str) -> None:
    mgr = KVCacheManager(num_blocks=5, block_size=4, hash_algo=algo)
    shared = list(range(8))
    admit(mgr, Req("a", [*shared, 99]))  # holds 0,1,2; 2 free
    b = Req("b", [*shared, 1, 2, 3, 4, 5])  # hits 0,1 (held by a) + 2 new
    assert admit(mgr, b) is not None
    assert mgr.get_block_ids("b") == (0, 1, 3, 4)
    assert [mgr.block_pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    mgr.check_invariants()


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize(("prompt_len", "hit_tokens"), [(8, 4), (9, 8), (7, 4), (4, 0)])
def test_never_the_whole_prompt(algo: str, prompt_len: int, hit_tokens: int) -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4, hash_algo=algo)
    admit(mgr, Req("a", list(range(12))))  # 3 cached blocks
    req = Req("b", list(range(prompt_len)))
    hits, num_hit_tokens = mgr.get_computed_blocks(req)
    assert num_hit_tokens == hit_tokens == 4 * len(hits)
    assert num_hit_tokens < prompt_len


def test_caching_disabled() -> None:
    events: list = []
    mgr = KVCacheManager(
        num_blocks=10, block_size=4, enable_caching=False, event_listener=events.append
    )
    admit(mgr, Req("a", list(range(12))))
    req = Req("b", list(range(12)))
    assert mgr.get_computed_blocks(req) == ([], 0)
    assert admit(mgr, req) is not None
    assert mgr.get_block_ids("b") == (3, 4, 5)
    assert mgr.cached_block_ids() == set()
    assert all(b.block_hash is None for b in mgr.block_pool.blocks)
    assert (mgr.stats.requests, mgr.stats.queries, mgr.stats.hits) == (0, 0, 0)
    assert events == []
    mgr.check_invariants()


@pytest.mark.parametrize("algo", ALGOS)
def test_reset_prefix_cache(algo: str) -> None:
    events: list = []
    mgr = KVCacheManager(num_blocks=6, block_size=4, hash_algo=algo, event_listener=events.append)
    a = Req("a", list(range(9)))
    admit(mgr, a)
    assert not mgr.reset_prefix_cache()
    assert mgr.cached_block_ids() == {0, 1}
    mgr.free(a)
    assert mgr.reset_prefix_cache()
    assert isinstance(events[-1], AllBlocksCleared)
    assert mgr.cached_block_ids() == set()
    assert all(b.block_hash is None for b in mgr.block_pool.blocks)
    assert mgr.get_computed_blocks(Req("b", list(range(9)))) == ([], 0)
    mgr.check_invariants()


@pytest.mark.parametrize("algo", ALGOS)
def test_chunked_prefill_caches_only_computed_blocks(algo: str) -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4, hash_algo=algo)
    req = Req("a", list(range(10)))
    assert [b.block_id for b in admit(mgr, req, num_new=5)] == [0, 1]
    assert mgr.cached_block_ids() == {0}  # block 1 holds 1 computed token
    assert [b.block_id for b in mgr.allocate_slots(req, 5)] == [2]
    req.num_computed_tokens += 5
    assert mgr.cached_block_ids() == {0, 1}
    mgr.check_invariants()


@pytest.mark.parametrize("algo", ALGOS)
def test_slots_beyond_known_tokens_are_not_cached(algo: str) -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4, hash_algo=algo)
    req = Req("a", list(range(5)))
    assert len(mgr.allocate_slots(req, 8)) == 2  # room for 8, only 5 known
    assert mgr.cached_block_ids() == {0}


@pytest.mark.parametrize("algo", ALGOS)
def test_duplicate_blocks_are_not_cached_twice(algo: str) -> None:
    # The seeds' example: the same prompt decoded twice fills an E-H block in
    # each request; block tables are append-only, so both copies exist.
    mgr = KVCacheManager(num_blocks=10, block_size=4, hash_algo=algo)
    r1 = Req("1", list(range(6)))
    admit(mgr, r1)
    r2 = Req("2", list(range(6)))
    admit(mgr, r2)
    assert mgr.get_block_ids("2") == (0, 2)  # hit on block 0 only
    for req in (r1, r2):
        for token in (6, 7):
            req.all_token_ids.append(token)
            mgr.allocate_slots(req, 1)
            req.num_computed_tokens += 1
    assert mgr.cached_block_ids() == {0, 1}
    assert mgr.block_pool.blocks[2].block_hash is None  # the duplicate
    mgr.check_invariants()
    mgr.free(r1)
    mgr.free(r2)
    assert mgr.free_block_ids()[-3:] == [1, 2, 0]
    # The cached copy (1) serves the next request; the duplicate (2) is plain.
    hits, _ = mgr.get_computed_blocks(Req("3", list(range(9))))
    assert [h.block_id for h in hits] == [0, 1]
    mgr.check_invariants()


def test_stale_hits_are_refused() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=2)
    a = Req("a", [1, 2, 3, 4, 5])
    admit(mgr, a)
    mgr.free(a)
    b = Req("b", [1, 2, 9, 9, 9])
    hits, _ = mgr.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0]
    admit(mgr, Req("c", [7, 7, 7, 7, 7]))  # pops 2,1,0: evicts the hit
    with pytest.raises(ValueError, match="stale hit"):
        mgr.allocate_slots(b, 3, hits)
    mgr.check_invariants()


def test_hits_for_a_request_that_holds_blocks_are_refused() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=2)
    a = Req("a", [1, 2, 3])
    admit(mgr, a)
    hits, _ = mgr.get_computed_blocks(Req("b", [1, 2, 3]))
    with pytest.raises(ValueError):
        mgr.allocate_slots(a, 1, hits)


def test_free_is_idempotent_and_forgets_the_request() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    a = Req("a", [1, 2, 3])
    admit(mgr, a)
    mgr.free(a)
    mgr.free(a)
    mgr.free("never-seen")
    assert mgr.get_block_ids("a") == ()
    assert mgr.num_free_blocks == 4
    mgr.check_invariants()


def test_usage_and_stats() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    assert mgr.usage == 0.0
    admit(mgr, Req("a", [1, 2, 3, 4, 5]))
    assert mgr.usage == 0.75 and mgr.num_free_blocks == 1
    admit(mgr, Req("b", [1, 2, 3, 4, 6]))
    stats = mgr.stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 10, 4)
    assert stats.hit_rate == pytest.approx(0.4)
    stats.reset()
    assert (stats.requests, stats.queries, stats.hits, stats.hit_rate) == (0, 0, 0, 0.0)


def test_check_invariants_catches_corruption() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    admit(mgr, Req("a", [1, 2, 3]))
    mgr.check_invariants()
    blocks = mgr.block_pool.blocks
    blocks[0].ref_cnt = 2
    with pytest.raises(AssertionError, match="block 0 has ref_cnt 2 but 1 block tables"):
        mgr.check_invariants()
    blocks[0].ref_cnt = 1
    blocks[1].block_hash = blocks[0].block_hash
    with pytest.raises(AssertionError, match="block 1"):
        mgr.check_invariants()
    blocks[1].block_hash = None
    mgr.block_pool.free_block_queue.remove(blocks[3])
    with pytest.raises(AssertionError, match="block 3 has ref_cnt 0 but is not free"):
        mgr.check_invariants()


def test_check_invariants_catches_a_corrupt_block_table() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    admit(mgr, Req("a", [1, 2, 3]))
    state = mgr._requests["a"]
    table = state.block_ids
    for corrupt, message in [
        (table + (table[0],), "holds a block twice"),
        (table + (9,), "not in the pool"),
        (list(table), "not a tuple"),  # the scheduler shares it with the runner as it is
    ]:
        state.block_ids = corrupt
        with pytest.raises(AssertionError, match=message):
            mgr.check_invariants()
    state.block_ids = table
    mgr.check_invariants()


def test_a_lookup_counts_once_its_allocation_succeeds() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    a = Req("a", [1, 2, 3, 4, 5])  # 3 blocks
    admit(mgr, a)
    b = Req("b", [1, 2, 3, 4, 6, 7])  # hits 2 blocks, needs 1 more, 1 free
    c = Req("c", [9, 9, 9, 9, 9])  # needs 3 blocks: waits
    assert admit(mgr, c) is None
    assert admit(mgr, c) is None  # looked up again next step: not counted again
    assert (mgr.stats.requests, mgr.stats.queries, mgr.stats.hits) == (1, 5, 0)
    assert admit(mgr, b) is not None
    assert (mgr.stats.requests, mgr.stats.queries, mgr.stats.hits) == (2, 11, 4)
    mgr.free(a)
    mgr.free(b)
    assert admit(mgr, c) is not None
    assert (mgr.stats.requests, mgr.stats.queries, mgr.stats.hits) == (3, 16, 4)
    # A running request's later allocations are not lookups.
    c.all_token_ids.append(1)
    mgr.allocate_slots(c, 1)
    assert mgr.stats.requests == 3


def test_a_pinned_prefix_outlives_any_churn_and_is_hit_whole():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    system = list(range(100, 110))  # 2 full blocks + 2 tokens
    first = Req("first", system + [1])
    admit(mgr, first)
    mgr.free(first)
    assert mgr.pin(system) == 8 and mgr.num_pinned_blocks == 2
    assert mgr.pin(system + [7, 7]) == 8 and mgr.num_pinned_blocks == 2  # held once
    mgr.check_invariants()
    for i in range(20):  # others fill every unpinned block, over and over
        other = Req(f"o{i}", [i] * 24)
        assert admit(mgr, other) is not None
        mgr.free(other)
        mgr.check_invariants()
    assert mgr.num_free_blocks == 6
    hits, num_hit = mgr.get_computed_blocks(Req("later", system + [5, 5, 5]))
    assert num_hit == 8 and [b.block_hash is not None for b in hits] == [True, True]
    assert not mgr.reset_prefix_cache()  # pinned blocks are in use for good
    assert mgr.pin([999] * 8) == 0  # nothing of it is cached: nothing to pin
