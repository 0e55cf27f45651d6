"""HybridKVCacheManager: one KVCacheManager per KV cache group (kv_cache/groups.py) over one
shared block pool, and a model's recurrent layers' state group (kv_cache/state_group.py)
over a pool of state slots, behind the interface the scheduler speaks to a single manager.

A prefix hit must serve every group: it is the longest prefix each group can serve, found
as vLLM's hybrid coordinator does. A full-attention group's hit is a prefix of the prompt
(any shorter prefix is a hit too); a sliding-window group needs only the last blocks
before the hit's end, so it is asked for its best hit within the full groups' one, and
every group again within the shortest answer until they agree. A state group's hit ends
at a snapshot of the state, so it is asked the same way. Allocation checks what every
group needs against the shared free queue (and the state group against its slots) before
any group takes a block, so a request gets room in all its groups or in none.

`get_block_ids` is the first group's table (the one a single-group model has);
`get_group_block_ids` gives the others, which the model runner turns into each group's
attention metadata; `take_state_step` what the step does with the request's state.

A second tier (kv_cache/host_tier.py) serves every group: the shared pool's evicted
blocks go to one tier file (a block's hash names its group, so one file holds every
group's), the state group's evicted snapshots to another, and each group's lookup counts
what its tier holds (`_hits` asks each group for no more than the groups before it found,
so none brings back blocks a shorter hit would not use).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kv_cache.block import BlockHash, KVCacheBlock
from kv_cache.block_pool import BlockPool, EventListener
from kv_cache.groups import KVCacheGroup
from kv_cache.host_tier import HostTier
from kv_cache.invariants import check_ref_counts
from kv_cache.manager import KVCacheManager
from kv_cache.request_state import RequestLike
from kv_cache.snapshot import PoolSnapshot, take_snapshot
from kv_cache.state_group import StateCacheManager, StateGroup, StateStep
from kv_cache.stats import BlockCounts, GroupBlocks, PrefixCacheStats
from kv_cache.tier_link import TierLink

GroupHits = list[list[KVCacheBlock | None]]


class HybridKVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        groups: Sequence[KVCacheGroup],
        enable_caching: bool = True,
        hash_algo: str = "builtin",
        event_listener: EventListener | None = None,
        state: StateGroup | None = None,
        tier: HostTier | None = None,
        state_tier: HostTier | None = None,
    ) -> None:
        """`tier`: the KV blocks' second tier; `state_tier`: the snapshots' (both or
        neither for a model with a state group)."""
        if len(groups) + (state is not None) < 2:
            raise ValueError("a hybrid KV cache manager needs two groups or more")
        if state_tier is not None and (tier is None or state is None):
            raise ValueError("a state tier needs a state group and a KV tier beside it")
        if tier is not None and state is not None and state_tier is None:
            raise ValueError("a hybrid model's KV tier needs its state group's tier too")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.tier = tier
        self.tier_link = TierLink(tier, event_listener) if tier is not None else None
        listener = self.tier_link.on_pool_event if self.tier_link is not None else event_listener
        self.block_pool = BlockPool(num_blocks, enable_caching, listener)
        self.groups = tuple(
            KVCacheManager(
                num_blocks,
                block_size,
                enable_caching,
                hash_algo,
                window=group.window,
                block_pool=self.block_pool,
                group_key=(("kv_cache_group", g),) if g else (),
                tier_link=self.tier_link,
            )  # fmt: skip
            for g, group in enumerate(groups)
        )
        self.state = (StateCacheManager(state, block_size, enable_caching, hash_algo, state_tier)
                      if state is not None else None)  # fmt: skip
        # Every group a hit must serve and an allocation must fit: the KV groups, the state.
        self.members = self.groups + ((self.state,) if self.state is not None else ())
        # The requests' prefix-cache figures: the first group's (each group counts the
        # same request, and a hit is the same number of tokens in every group).
        self.stats: PrefixCacheStats = self.groups[0].stats

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.block_pool.free_block_queue)

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_pinned_blocks(self) -> int:
        return 0

    def max_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request holds at once, in all its groups together."""
        return sum(group.max_blocks(num_tokens, max_chunk) for group in self.groups)

    def get_computed_blocks(self, req: RequestLike) -> tuple[GroupHits, int]:
        """Each group's hit blocks for the longest prefix every group serves, and its
        length in tokens."""
        if not self.enable_caching:
            return [[] for _ in self.members], 0
        limit: int | None = None
        while True:
            hits = self._hits(req, limit)
            if limit is None and self.state is not None:  # the KV groups' own hit
                self.state.note_shared_prefix(req, min(len(h) for h in hits[:-1]))
            shortest = min(len(h) for h in hits)
            if all(len(h) == shortest for h in hits):
                break
            limit = shortest
        num_hit_tokens = shortest * self.block_size
        for group in self.groups:  # the lookup each counts once allocated: the common one
            state = group._state(req)
            state.pending_lookup = (len(req.all_token_ids), num_hit_tokens)
        return hits, num_hit_tokens

    def _hits(self, req: RequestLike, limit: int | None) -> GroupHits:
        """Each group's hit, at most `limit` blocks and none past a group before it: no
        group brings back from a tier what another group's shorter hit would not use."""
        hits: GroupHits = []
        for group in self.members:
            hits.append(group.get_computed_blocks(req, limit)[0])
            limit = len(hits[-1]) if limit is None else min(limit, len(hits[-1]))
        return hits

    def num_cached_tokens(self, req: RequestLike) -> int:
        if not self.enable_caching:
            return 0
        num_tokens = self.get_computed_blocks(req)[1]
        for group in self.groups:  # a ranking only: nothing to count later
            group._state(req).pending_lookup = None
        return num_tokens

    def allocate_slots(
        self, req: RequestLike, num_new_tokens: int, hits: GroupHits | None = None
    ) -> list[KVCacheBlock] | None:
        """Room for num_new_tokens in every group, or None with no block taken. Returns
        the blocks newly allocated across the groups."""
        hits = hits or [[] for _ in self.members]
        state = self.state
        if (
            state is not None
            and req.num_computed_tokens == 0
            and (state.waits_for_snapshot(req, len(hits[-1])))
        ):
            return None  # a step later it resumes from the snapshot being written
        needed = sum(
            group.num_blocks_needed(req, num_new_tokens, h)
            for group, h in zip(self.groups, hits[: len(self.groups)], strict=True)
        )
        if needed > len(self.block_pool.free_block_queue):
            return None
        if state is not None and state.num_blocks_needed(req, num_new_tokens, hits[-1]) > (
            state.num_free_slots
        ):
            return None
        for group, h in zip(self.members, hits, strict=True):
            group.take_hits(req, h)  # all hits held before any group evicts for new blocks
        return [
            block
            for group, h in zip(self.members, hits, strict=True)
            for block in group.allocate_new(req, num_new_tokens, len(h))
        ]

    def free(self, req: RequestLike | str) -> None:
        for group in self.members:
            group.free(req)

    def trim(self, req: RequestLike) -> int:
        return sum(group.trim(req) for group in self.members)

    def uncache_unwritten(self, request_id: str, num_written_tokens: int) -> None:
        for group in self.members:
            group.uncache_unwritten(request_id, num_written_tokens)

    def take_tier_moves(self) -> tuple[list[tuple[int, BlockHash]], dict[int, bytes]]:
        """The KV blocks the engine must copy before the step (`TierLink.take`)."""
        return self.tier_link.take() if self.tier_link is not None else ([], {})

    def take_state_tier_moves(self) -> tuple[list[tuple[int, BlockHash]], dict[int, bytes]]:
        """The snapshot slots the engine must copy before the step (`TierLink.take`)."""
        link = self.state.tier_link if self.state is not None else None
        return link.take() if link is not None else ([], {})

    @property
    def state_tier(self) -> HostTier | None:
        return self.state.tier if self.state is not None else None

    def cached_blocks(self) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of every block the shared pool caches, every group's."""
        return self.groups[0].cached_blocks()  # (any group's: they share the pool)

    def cached_snapshots(self) -> list[tuple[int, BlockHash]]:
        """(slot, hash) of every snapshot the state group caches."""
        if self.state is None:
            return []
        return [(b.block_id, h) for h, b in self.state.pool.cached_hash_to_block.items()]

    def take_state_step(self, request_id: str) -> StateStep | None:
        """What the request's step does with its state (kv_cache/state_group.py), or None
        for a model without a state group."""
        return self.state.take_step(request_id) if self.state is not None else None

    def get_block_ids(self, request_id: str) -> tuple[int, ...]:
        return self.groups[0].get_block_ids(request_id)

    def get_group_block_ids(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """The tables of the groups after the first, in group order."""
        return tuple(group.get_block_ids(request_id) for group in self.groups[1:])

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return [b for group in self.groups for b in group.get_blocks(request_id)]

    def block_counts(self) -> BlockCounts:
        """The pool's counts, with each group's in-use blocks (O(groups))."""
        groups = tuple(
            GroupBlocks(g, "full" if m.window is None else f"sliding_window={m.window}",
                        m.num_blocks_in_use)
            for g, m in enumerate(self.groups)
        )  # fmt: skip
        counts = dataclasses.replace(self.block_pool.block_counts(), groups=groups)
        if self.state is not None:
            counts = dataclasses.replace(counts, states=self.state.slot_counts())
        return counts

    def snapshot(self, max_prefixes: int = 10) -> PoolSnapshot:
        tables = [t for group in self.groups for t in group.held_tables()]
        return take_snapshot(self.block_pool, tables, max_prefixes, self.block_counts())

    def pin(self, token_ids: list[int], extra_keys: tuple = ()) -> int:
        raise ValueError("pinning a prefix is not supported for hybrid models yet")

    def reset_prefix_cache(self) -> bool:
        if self.state is not None and self.state.num_slots_in_use:
            return False  # (checked first: neither pool is cleared unless both can be)
        if not self.block_pool.reset_prefix_cache():
            return False
        return self.state is None or self.state.reset_prefix_cache()

    def check_invariants(self) -> None:
        if self.state is not None:
            self.state.check_invariants()
        self.block_pool.check_invariants()
        holders = [0] * self.block_pool.num_blocks
        for group in self.groups:
            for block_id, n in enumerate(group.count_holders()):
                holders[block_id] += n
        check_ref_counts(self.block_pool, holders)


def kv_cache_manager_for(
    groups: Sequence[KVCacheGroup] | None,
    num_blocks: int,
    block_size: int,
    enable_caching: bool = True,
    hash_algo: str = "builtin",
    event_listener: EventListener | None = None,
    tier: HostTier | None = None,
    state: StateGroup | None = None,
    state_tier: HostTier | None = None,
) -> KVCacheManager | HybridKVCacheManager:
    """The manager of a model with these KV cache groups (None: one full-attention group)
    and state group (None: no recurrent layers): a `KVCacheManager` for one group, a hybrid
    one over a shared pool for several or beside a state group. `tier` and `state_tier`:
    the second tiers of its KV blocks and of its snapshots."""
    groups = groups or ()
    if len(groups) < 2 and state is None:
        window = groups[0].window if groups else None
        return KVCacheManager(num_blocks, block_size, enable_caching, hash_algo,
                              event_listener, tier, window)  # fmt: skip
    return HybridKVCacheManager(num_blocks, block_size, groups or (KVCacheGroup(None, ()),),
                                enable_caching, hash_algo, event_listener, state, tier,
                                state_tier)  # fmt: skip
