"""The seeds' prefix-caching walkthrough (DESIGN.md test vector), driven
exactly the way the scheduler drives the manager."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kv_cache import BlockRemoved, BlockStored, KVCacheManager


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    extra_keys: tuple = field(default_factory=tuple)


def toks(text: str) -> list[int]:
    return [ord(c) for c in text]


def admit(mgr: KVCacheManager, req: Req) -> list[int]:
    """A new request's whole prompt in one step; returns the hit block ids."""
    hits, num_hit_tokens = mgr.get_computed_blocks(req)
    num_new = len(req.all_token_ids) - num_hit_tokens
    assert mgr.allocate_slots(req, num_new, hits) is not None
    req.num_computed_tokens += num_hit_tokens + num_new
    return [block.block_id for block in hits]


def decode(mgr: KVCacheManager, req: Req, token: str) -> list[int]:
    req.all_token_ids.append(ord(token))
    new = mgr.allocate_slots(req, 1)
    assert new is not None
    req.num_computed_tokens += 1
    return [block.block_id for block in new]


@pytest.mark.parametrize("algo", ["builtin", "sha256"])
def test_seed_walkthrough(algo: str) -> None:
    events: list = []
    mgr = KVCacheManager(num_blocks=10, block_size=4, hash_algo=algo, event_listener=events.append)

    def stored() -> list[int]:
        return [e.block_id for e in events if isinstance(e, BlockStored)]

    def removed() -> list[int]:
        return [e.block_id for e in events if isinstance(e, BlockRemoved)]

    # Time 1: req 0, prompt A..O: blocks 0,1,2 full and cached, 3 holds 3/4.
    req0 = Req("0", toks("ABCDEFGHIJKLMNO"))
    assert admit(mgr, req0) == []
    assert mgr.get_block_ids("0") == (0, 1, 2, 3)
    assert mgr.free_block_ids() == [4, 5, 6, 7, 8, 9]
    assert mgr.cached_block_ids() == {0, 1, 2}
    assert stored() == [0, 1, 2]
    mgr.check_invariants()

    # Time 2-3: req 0 decodes P (block 3 becomes full and cached), then Q.
    assert decode(mgr, req0, "P") == []
    assert mgr.cached_block_ids() == {0, 1, 2, 3}
    assert decode(mgr, req0, "Q") == [4]
    assert mgr.get_block_ids("0") == (0, 1, 2, 3, 4)
    assert mgr.free_block_ids() == [5, 6, 7, 8, 9]
    assert mgr.cached_block_ids() == {0, 1, 2, 3}
    mgr.check_invariants()

    # Time 4: req 1 shares A..J: hits on 0,1 only (block 2 matches 2/4).
    req1 = Req("1", toks("ABCDEFGHIJwxyz"))
    assert admit(mgr, req1) == [0, 1]
    assert mgr.get_block_ids("1") == (0, 1, 5, 6)
    assert mgr.free_block_ids() == [7, 8, 9]
    assert mgr.cached_block_ids() == {0, 1, 2, 3, 5}
    assert (mgr.stats.queries, mgr.stats.hits) == (15 + 14, 8)
    mgr.check_invariants()

    # Time 5: req 0 finishes: 4,3,2 to the tail in reverse; 0,1 still used.
    mgr.free(req0)
    assert mgr.free_block_ids() == [7, 8, 9, 4, 3, 2]
    assert mgr.get_block_ids("0") == ()
    mgr.check_invariants()

    # Time 6: req 1 finishes.
    mgr.free(req1)
    assert mgr.free_block_ids() == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    assert mgr.num_free_blocks == 10 and mgr.usage == 0.0
    assert mgr.cached_block_ids() == {0, 1, 2, 3, 5}
    mgr.check_invariants()

    # Time 7: req 2 shares A..L: hits 0,1,2 leave the queue; 7,8,9,4,3 are
    # popped and 3 (a cached block) is evicted.
    assert removed() == []
    req2 = Req("2", toks("ABCDEFGHIJKL") + toks("abcdefghijklmnopq"))
    assert len(req2.all_token_ids) == 29
    assert admit(mgr, req2) == [0, 1, 2]
    assert mgr.get_block_ids("2") == (0, 1, 2, 7, 8, 9, 4, 3)
    assert mgr.free_block_ids() == [6, 5]
    assert removed() == [3]
    assert mgr.cached_block_ids() == {0, 1, 2, 5, 7, 8, 9, 4}
    assert mgr.block_pool.blocks[3].block_hash is None
    assert stored() == [0, 1, 2, 3, 5, 7, 8, 9, 4]
    assert (mgr.stats.requests, mgr.stats.queries, mgr.stats.hits) == (3, 58, 20)
    assert mgr.usage == pytest.approx(0.8)
    mgr.check_invariants()

    mgr.free(req2)
    assert mgr.num_free_blocks == 10
    mgr.check_invariants()


@pytest.mark.parametrize("algo", ["builtin", "sha256"])
def test_stored_events_chain_parents(algo: str) -> None:
    events: list = []
    mgr = KVCacheManager(num_blocks=4, block_size=2, hash_algo=algo, event_listener=events.append)
    admit(mgr, Req("a", [1, 2, 3, 4, 5]))
    assert [e.block_id for e in events] == [0, 1]
    first, second = events
    assert first.parent_block_hash is None
    assert second.parent_block_hash == first.block_hash
    assert mgr.block_pool.blocks[1].block_hash == second.block_hash
