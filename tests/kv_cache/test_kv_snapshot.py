"""The pool's block counts by state and its snapshot (what metrics and the dashboard show)."""

from __future__ import annotations

import random

import pytest

from kv_cache import BlockCounts, KVCacheManager, PrefixGroup
from kv_cache.block_pool import ROOT_PREVIEW_TOKENS
from kv_cache.snapshot import CACHED, FREE, IN_USE
from tests.kv_cache.test_kv_manager import Req, admit


def brute_force_states(mgr: KVCacheManager) -> str:
    return "".join(
        IN_USE if b.ref_cnt else CACHED if b.block_hash is not None else FREE
        for b in mgr.block_pool.blocks
    )


def counts_of(states: str) -> BlockCounts:
    return BlockCounts(states.count(FREE), states.count(CACHED), states.count(IN_USE))


def check(mgr: KVCacheManager) -> None:
    mgr.check_invariants()
    states = brute_force_states(mgr)
    assert mgr.block_counts() == counts_of(states)
    snap = mgr.snapshot()
    assert snap.block_states == states
    assert snap.counts == counts_of(states)


def test_fresh_pool_is_all_free() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    assert mgr.block_counts() == BlockCounts(free=8, cached=0, in_use=0)
    snap = mgr.snapshot()
    assert snap.block_states == FREE * 8 and snap.prefixes == ()
    assert snap.counts.total == 8


@pytest.mark.parametrize("algo", ["builtin", "sha256"])
def test_counts_follow_use_free_hit_evict_and_reset(algo: str) -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=4, hash_algo=algo)
    admit(mgr, Req("a", list(range(9))))  # 2 full cached blocks + 1 partial
    assert mgr.block_counts() == BlockCounts(free=3, cached=0, in_use=3)
    check(mgr)
    mgr.free("a")  # the full ones stay cached, the partial one is just free
    assert mgr.block_counts() == BlockCounts(free=4, cached=2, in_use=0)
    check(mgr)
    admit(mgr, Req("b", [*range(8), 50]))  # hits both cached blocks
    assert mgr.block_counts() == BlockCounts(free=3, cached=0, in_use=3)
    check(mgr)
    mgr.free("b")
    admit(mgr, Req("c", list(range(100, 124))))  # 6 new blocks: evicts both cached ones
    assert mgr.block_counts() == BlockCounts(free=0, cached=0, in_use=6)
    check(mgr)
    mgr.free("c")
    assert mgr.block_counts().cached == 6
    assert mgr.reset_prefix_cache()
    assert mgr.block_counts() == BlockCounts(free=6, cached=0, in_use=0)
    check(mgr)


def test_prefix_groups_gather_a_shared_prefix_and_its_requests_tails() -> None:
    mgr = KVCacheManager(num_blocks=32, block_size=4)
    shared = list(range(1000, 1008))  # two full blocks
    for i in range(3):
        admit(mgr, Req(f"r{i}", [*shared, *range(10 * i, 10 * i + 6)]))  # 1 full + 1 partial own
    admit(mgr, Req("other", list(range(500, 505))))  # 1 full + 1 partial, its own prefix
    check(mgr)
    first, second = mgr.snapshot().prefixes
    # The shared 2 blocks and each request's own 2 blocks.
    assert (first.num_blocks, first.num_requests) == (2 + 3 * 2, 3)
    assert first.token_ids == tuple(shared[:4])  # the first block's tokens
    assert first.first_block_id == mgr.get_block_ids("r0")[0]
    assert (second.num_blocks, second.num_requests) == (2, 1)
    assert second.token_ids == (500, 501, 502, 503)
    for i in range(3):
        mgr.free(f"r{i}")
    check(mgr)
    first = mgr.snapshot().prefixes[0]
    # Freed: the full blocks stay cached under the shared prefix, the partial tails go.
    assert (first.num_blocks, first.num_requests) == (2 + 3, 0)
    assert first.token_ids == tuple(shared[:4])
    assert mgr.snapshot(max_prefixes=1).prefixes == (first,)


def test_a_request_without_a_full_block_is_its_own_group() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    admit(mgr, Req("short", [7, 8]))
    (group,) = mgr.snapshot().prefixes
    assert group == PrefixGroup(first_block_id=mgr.get_block_ids("short")[0], num_blocks=1,
                                num_requests=1, token_ids=())  # fmt: skip


def test_salted_prompts_are_never_kept_for_display() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    admit(mgr, Req("tenant", list(range(8)), extra_keys=("salt",)))
    (group,) = mgr.snapshot().prefixes
    assert group.num_blocks == 2 and group.token_ids == ()
    assert mgr.block_pool.root_tokens == {}


def test_preview_is_bounded_and_leaves_with_its_first_block() -> None:
    block_size = ROOT_PREVIEW_TOKENS * 2
    mgr = KVCacheManager(num_blocks=2, block_size=block_size)
    admit(mgr, Req("a", list(range(block_size + 1))))
    (group,) = mgr.snapshot().prefixes
    assert group.token_ids == tuple(range(ROOT_PREVIEW_TOKENS))
    mgr.free("a")
    admit(mgr, Req("b", list(range(5000, 5000 + 2 * block_size))))  # evicts a's blocks
    assert list(mgr.block_pool.root_tokens.values()) == [tuple(range(5000, 5032))]  # b's only
    check(mgr)


def test_counts_match_brute_force_under_random_traffic() -> None:
    rng = random.Random(0)
    mgr = KVCacheManager(num_blocks=24, block_size=4)
    prefixes = [[rng.randrange(100) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
    live: list[str] = []
    for step in range(400):
        if live and rng.random() < 0.45:
            mgr.free(live.pop(rng.randrange(len(live))))
        else:
            tokens = [*rng.choice(prefixes), *(rng.randrange(100) for _ in range(rng.randrange(6)))]
            if admit(mgr, Req(f"q{step}", tokens)) is not None:
                live.append(f"q{step}")
            else:
                mgr.free(f"q{step}")
        if step % 7 == 0 and not live:
            mgr.reset_prefix_cache()
        check(mgr)
        snap = mgr.snapshot(max_prefixes=100)
        # Every cached or held block is in exactly one group; every holder in one.
        assert sum(g.num_blocks for g in snap.prefixes) == snap.counts.cached + snap.counts.in_use
        assert sum(g.num_requests for g in snap.prefixes) == len(live)
