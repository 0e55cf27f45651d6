"""KV cache groups: the layout of a hybrid model's layers, a sliding-window group's block
table, and the hybrid manager's hits and allocations over one shared pool."""

from __future__ import annotations

import pytest

from kv_cache import KVCacheManager
from kv_cache.groups import KVCacheGroup, group_size, kv_cache_groups, layer_slots
from kv_cache.host_tier import HEADER_BYTES, HostTier
from kv_cache.hybrid import HybridKVCacheManager
from kv_cache.request_state import SKIPPED
from tests.kv_cache.test_kv_manager import Req, admit


def decode(mgr, req: Req, token: int) -> list | None:
    """One decode step: the token sampled last is computed now."""
    req.all_token_ids.append(token)
    new = mgr.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
    return new


def held(mgr, request_id: str) -> int:
    return len(mgr.get_blocks(request_id))


# ------------------------------------------------------------------------- layout


def test_gemma3_shaped_layout_groups_layers_by_kind_in_groups_of_one_size():
    """26 layers, every sixth full (Gemma 3 1B): 4 full layers, 22 sliding ones."""
    windows = [None if i % 6 == 5 else 512 for i in range(26)]
    groups = kv_cache_groups(windows)
    assert groups[0] == KVCacheGroup(None, (5, 11, 17, 23))
    assert [g.window for g in groups] == [None] + [512] * 6
    assert group_size(groups) == 4  # four cache tensors, each shared by one layer per group
    assert sorted(layer for g in groups for layer in g.layers) == list(range(26))
    slots = layer_slots(groups, 26)
    assert slots[5] == (0, 0) and slots[0] == (1, 0) and slots[25] == (6, 1)


def test_a_model_of_one_kind_is_one_group():
    assert kv_cache_groups([None] * 3) == (KVCacheGroup(None, (0, 1, 2)),)
    assert kv_cache_groups([64] * 2) == (KVCacheGroup(64, (0, 1)),)
    with pytest.raises(ValueError, match=">= 1 token"):
        kv_cache_groups([0, None])


# ------------------------------------------------------------------ sliding window


def test_a_sliding_group_gives_back_blocks_its_window_passed():
    mgr = KVCacheManager(num_blocks=64, block_size=4, window=8)
    req = Req("a", list(range(10)))
    admit(mgr, req)  # 3 blocks: tokens 0-9
    assert held(mgr, "a") == 3
    for t in range(100, 130):
        assert decode(mgr, req, t) is not None
        mgr.check_invariants()
        # the next token (position num_computed) reads 8 keys back: 2-3 blocks, +1 to write
        assert held(mgr, "a") <= 8 // 4 + 2
    table = mgr.get_block_ids("a")
    assert len(table) == -(-len(req.all_token_ids) // 4)  # indexed by position still
    assert table[0] == SKIPPED
    mgr.free(req)
    mgr.check_invariants()
    assert mgr.num_free_blocks == 64


def test_gemma3_request_of_8000_tokens_holds_at_most_window_over_block_size_plus_two():
    """The issue's bound: 512-token window, 16-token blocks, a request decoding past 8,000
    tokens (its prompt prefilled in 512-token chunks)."""
    mgr = HybridKVCacheManager(2048, 16, kv_cache_groups([512, 512, 512, 512, 512, None]))
    req = Req("a", list(range(7000)))
    hits, _ = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, 512, hits) is not None
    req.num_computed_tokens = 512
    while req.num_computed_tokens < 7000:
        n = min(512, 7000 - req.num_computed_tokens)
        assert mgr.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
    for t in range(1100):
        assert decode(mgr, req, t) is not None
        sliding = mgr.groups[1].get_blocks("a")
        assert len(sliding) <= 512 // 16 + 2
    assert len(req.all_token_ids) == 8100
    assert len(mgr.groups[0].get_blocks("a")) == -(-8100 // 16)  # full: every block
    mgr.check_invariants()


def test_a_sliding_hit_needs_only_the_blocks_its_window_reads():
    bs, window = 4, 8
    mgr = KVCacheManager(num_blocks=32, block_size=bs, window=window)
    prompt = list(range(40))
    first = Req("a", prompt + [999])
    admit(mgr, first)
    for t in range(10):
        decode(mgr, first, 1000 + t)
    mgr.free(first)
    mgr.check_invariants()
    # Evict the prompt's first blocks: a full group would now miss altogether.
    pool = mgr.block_pool
    for block_hash in list(pool.cached_hash_to_block)[:3]:
        pool.uncache(pool.cached_hash_to_block[block_hash])
    second = Req("b", prompt + [7, 7, 7])
    hits, num_hit_tokens = mgr.get_computed_blocks(second)
    assert num_hit_tokens == 40  # every prompt block: the last 2 (8 keys) are cached
    need = -(-(window - 1) // bs)
    assert all(h is None for h in hits[:-need]) and all(h is not None for h in hits[-need:])
    assert mgr.allocate_slots(second, 3, hits) is not None
    assert mgr.get_block_ids("b")[: len(hits) - need] == (SKIPPED,) * (len(hits) - need)
    mgr.check_invariants()


def test_a_sliding_hit_stops_before_a_block_its_window_reads_is_missing():
    mgr = KVCacheManager(num_blocks=32, block_size=4, window=8)
    prompt = list(range(40))
    admit(mgr, Req("a", prompt + [1]))
    mgr.free("a")
    pool = mgr.block_pool
    state = mgr._lookup(Req("probe", prompt + [1]))[0]
    pool.uncache(pool.cached_hash_to_block[state.block_hashes[8]])  # tokens 32-35
    _, num_hit_tokens = mgr.get_computed_blocks(Req("b", prompt + [5]))
    # block 9 alone is not enough (2 needed): the best hit ends where block 8 starts
    assert num_hit_tokens == 8 * 4


# ------------------------------------------------------------------------- hybrid


def hybrid(num_blocks: int = 64, window: int = 8) -> HybridKVCacheManager:
    return HybridKVCacheManager(num_blocks, 4, kv_cache_groups([window, None]))


def test_hybrid_allocates_in_every_group_or_none():
    mgr = hybrid(num_blocks=7)
    a = Req("a", list(range(12)))  # 3 blocks in each group: 6
    assert admit(mgr, a) is not None
    before = (mgr.num_free_blocks, mgr.get_block_ids("b"), mgr.get_group_block_ids("b"))
    assert admit(mgr, Req("b", list(range(100, 105)))) is None  # 2 + 2 needed, 1 free
    assert (mgr.num_free_blocks, mgr.get_block_ids("b"), mgr.get_group_block_ids("b")) == before
    mgr.check_invariants()
    mgr.free(a)
    assert mgr.num_free_blocks == 7
    mgr.check_invariants()


def test_hybrid_hit_is_the_prefix_every_group_serves_and_groups_keep_their_own_blocks():
    mgr = hybrid()
    prompt = list(range(24))
    a = Req("a", prompt + [1])
    admit(mgr, a)
    full, (sliding,) = mgr.get_block_ids("a"), mgr.get_group_block_ids("a")
    assert not set(full) & set(sliding)  # the same tokens hold other layers' K/V
    mgr.free(a)
    b = Req("b", prompt + [2])
    hits, num_hit_tokens = mgr.get_computed_blocks(b)
    assert num_hit_tokens == 24 and [len(h) for h in hits] == [6, 6]
    assert mgr.allocate_slots(b, 1, hits) is not None
    assert mgr.get_block_ids("b")[:6] == full[:6]
    assert mgr.get_group_block_ids("b")[0][4:6] == sliding[4:6]  # the window's blocks
    assert mgr.stats.hits == 24 and mgr.stats.requests == 2
    mgr.check_invariants()


def test_hybrid_hit_shrinks_to_what_the_sliding_group_still_holds():
    mgr = hybrid()
    prompt = list(range(24))
    admit(mgr, Req("a", prompt + [1]))
    mgr.free("a")
    window_group = mgr.groups[1]  # groups: full first, then the window's
    state = window_group._lookup(Req("probe", prompt + [1]))[0]
    pool = mgr.block_pool
    for i in (4, 5):  # the sliding blocks a 24-token hit would read
        pool.uncache(pool.cached_hash_to_block[state.block_hashes[i]])
    hits, num_hit_tokens = mgr.get_computed_blocks(Req("b", prompt + [2]))
    assert num_hit_tokens == 16  # blocks 2-3 still cached serve a 16-token hit
    assert [len(h) for h in hits] == [4, 4]
    mgr.check_invariants()


def test_hybrid_hit_with_a_tier_that_lengthens_one_group_only_ends_at_the_shortest(tmp_path):
    """The full group's blocks come back from the tier, the sliding group's last blocks are
    nowhere: the groups agree on the sliding group's hit (the tier's restore had ignored
    the limit, and the agreement loop never ended)."""
    tier = HostTier(tmp_path / "tier.bin", HEADER_BYTES + 64 * (8 + 36), 8, "fake")
    mgr = HybridKVCacheManager(64, 4, kv_cache_groups([8, None]), hash_algo="sha256", tier=tier)
    prompt = list(range(24))
    admit(mgr, Req("a", prompt + [1]))
    mgr.free("a")
    probe = Req("probe", prompt + [1])
    full, window = (group._lookup(probe)[0].block_hashes for group in mgr.groups)
    pool = mgr.block_pool
    for i in (2, 3, 4, 5):  # the full group's, kept by the tier only
        pool.uncache(pool.cached_hash_to_block[full[i]])
        tier.put(full[i], bytes(8))
    for i in (4, 5):  # the sliding blocks a 24-token hit would read: gone
        pool.uncache(pool.cached_hash_to_block[window[i]])
    hits, num_hit_tokens = mgr.get_computed_blocks(Req("b", prompt + [2]))
    assert num_hit_tokens == 16 and [len(h) for h in hits] == [4, 4]
    assert mgr.stats.tier_hits >= 8  # the full group's blocks 2-3 came back
    mgr.check_invariants()


def test_hybrid_preempted_request_resumes_from_its_cached_blocks():
    mgr = hybrid(num_blocks=64)
    req = Req("a", list(range(30)))
    admit(mgr, req)
    for t in range(20):
        decode(mgr, req, t)
    mgr.free(req)  # preempted: recompute
    req.num_computed_tokens = 0
    hits, num_hit_tokens = mgr.get_computed_blocks(req)
    assert num_hit_tokens == (len(req.all_token_ids) - 1) // 4 * 4
    assert mgr.allocate_slots(req, len(req.all_token_ids) - num_hit_tokens, hits) is not None
    mgr.check_invariants()
    mgr.free(req)
    assert mgr.num_free_blocks == 64


def test_hybrid_takes_every_groups_hits_before_any_group_takes_new_blocks():
    """A sliding group's early blocks go back to the free queue while the request runs, so
    they sit at its head: the full group's new blocks must not evict them when a later
    request hits them (found by the golden test: one block in both tables)."""
    mgr = hybrid(num_blocks=11)
    prefix = list(range(8))
    a = Req("a", prefix + [50])
    admit(mgr, a)
    for t in range(11):  # the sliding group gives back blocks 0 and 1
        decode(mgr, a, 100 + t)
    mgr.free(a)
    b = Req("b", prefix + [60, 61, 62, 63, 64, 65, 66, 67, 68])
    hits, num_hit_tokens = mgr.get_computed_blocks(b)
    assert num_hit_tokens == 8
    head = [b.block_id for b in mgr.block_pool.free_block_queue][:4]
    assert {h.block_id for h in hits[1] if h is not None} & set(head)  # where eviction starts
    assert mgr.allocate_slots(b, 9, hits) is not None
    full, (sliding,) = mgr.get_block_ids("b"), mgr.get_group_block_ids("b")
    assert not set(full) & set(sliding)
    assert sliding[:2] == tuple(h.block_id for h in hits[1])
    mgr.check_invariants()


def test_hybrid_block_counts_say_what_each_group_holds():
    mgr = hybrid(num_blocks=64)  # groups: full, then a window of 8 tokens
    req = Req("a", list(range(10)))
    admit(mgr, req)
    for t in range(20):
        decode(mgr, req, t)
    counts = mgr.block_counts()
    full, sliding = counts.groups
    assert (full.attention, sliding.attention) == ("full", "sliding_window=8")
    assert full.in_use == len(mgr.groups[0].get_blocks("a")) == 8  # 30 tokens, every block
    assert sliding.in_use == len(mgr.groups[1].get_blocks("a")) <= 8 // 4 + 2
    assert full.in_use + sliding.in_use == counts.in_use
    mgr.check_invariants()
    mgr.free(req)
    assert [g.in_use for g in mgr.block_counts().groups] == [0, 0]
