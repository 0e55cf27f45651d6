"""TierLink: what moves between a block pool and its second tier (host_tier.py): the KV
blocks' pool, or a state group's snapshot slots (kv_cache/state_group.py), each with a tier
of its own.

The pool evicts a cached block: its bytes must reach the tier before the block is reused
(an offload). A lookup that misses in the pool continues in the tier: the blocks it brings
back are cached in free blocks at once, their bytes written before the next step runs (a
load). The manager owns one link; the engine takes the pending moves between a schedule()
and the step that runs it (`KVCacheManager.take_tier_moves`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kv_cache.block import BlockHash, KVCacheBlock
from kv_cache.block_pool import BlockPool, BlockRemoved, EventListener, KVCacheEvent
from kv_cache.host_tier import HostTier


class InTier:
    """The type of `IN_TIER`: a block the tier holds and the pool does not."""


IN_TIER = InTier()


class _Request(Protocol):
    all_token_ids: list[int]


class TierLink:
    def __init__(self, tier: HostTier, event_listener: EventListener | None) -> None:
        self.tier = tier
        self._event_listener = event_listener
        self._offloads: list[tuple[int, BlockHash]] = []  # evicted: copy out before reuse
        self._loads: dict[int, tuple[BlockHash, bytes]] = {}  # brought back: copy in

    def on_pool_event(self, event: KVCacheEvent) -> None:
        """The pool's listener: an evicted block's bytes are to be copied out."""
        if isinstance(event, BlockRemoved):
            pending = self._loads.pop(event.block_id, None)
            # A block brought back and evicted again before its bytes arrived: the tier
            # still holds it, and the pool never held its contents.
            if pending is None and event.block_hash not in self.tier:
                self._offloads.append((event.block_id, event.block_hash))
        if self._event_listener is not None:
            self._event_listener(event)

    def restore(
        self,
        pool: BlockPool,
        block_size: int,
        req: _Request,
        hashes: Sequence[BlockHash],
        hits: list[KVCacheBlock],
        max_blocks: int | None = None,
    ) -> list[KVCacheBlock]:
        """The blocks the tier gives back to continue `hits` (req's cached prefix in the
        pool; `hashes` its block hashes) up to `max_blocks` in all, when the pool has room
        for the whole request: each is cached in a free block now, its bytes copied in
        before the next step."""
        num_tokens = len(req.all_token_ids)
        limit = (num_tokens - 1) // block_size  # as a lookup: the last token is computed
        if max_blocks is not None:  # (a hybrid's other groups serve no more: kv_cache/hybrid.py)
            limit = min(limit, max_blocks)
        first = len(hits)
        if first >= limit or hashes[first] not in self.tier:
            return []
        # The request's hits stay out of reach while blocks are taken from the free head.
        needed = -(-num_tokens // block_size) - first
        if needed > len(pool.free_block_queue) - sum(1 for b in hits if b.ref_cnt == 0):
            return []
        pool.touch(hits)
        restored = []
        for index in range(first, limit):
            block = self.bring_back(pool, hashes, index)
            if block is None:
                break
            restored.append(block)
        pool.free_blocks(reversed(hits))
        return restored

    def with_tier(self, pool: BlockPool) -> Callable[[BlockHash], KVCacheBlock | InTier | None]:
        """A lookup that finds the pool's cached blocks, and `IN_TIER` for a block only the
        tier holds (a sliding-window group's search counts both as cached)."""
        cached, tier = pool.cached_hash_to_block.get, self.tier

        def lookup(block_hash: BlockHash) -> KVCacheBlock | InTier | None:
            block = cached(block_hash)
            return block if block is not None else IN_TIER if block_hash in tier else None

        return lookup

    def lengthen(
        self,
        pool: BlockPool,
        hashes: Sequence[BlockHash],
        hits: list[KVCacheBlock | None],
        search: Callable[[Callable], list],
    ) -> tuple[list[KVCacheBlock | None], int]:
        """A sliding-window group's `hits` (the pool's own) made the longest hit the pool and
        the tier serve together (`search`: the group's search through a lookup), its blocks
        brought back; and how many came back."""
        found = search(self.with_tier(pool))
        if len(found) <= len(hits):
            return hits, 0
        num_restored = sum(1 for block in found if block is IN_TIER)
        longer = self.bring_back_all(pool, hashes, found)
        if longer is None:  # (blocks were taken from the free head: the pool's hit again)
            return search(pool.cached_hash_to_block.get), 0
        return longer, num_restored

    def bring_back_all(
        self,
        pool: BlockPool,
        hashes: Sequence[BlockHash],
        found: list[KVCacheBlock | InTier | None],
    ) -> list[KVCacheBlock | None] | None:
        """`found` (a hit through `with_tier`) with each `IN_TIER` brought back into the
        pool, or None when one could not be (torn, or no free block). The pool's blocks in
        it stay out of reach while blocks are taken from the free head."""
        held = [b for b in found if isinstance(b, KVCacheBlock)]
        pool.touch(held)
        hits: list[KVCacheBlock | None] | None = []
        for index, block in enumerate(found):
            if block is IN_TIER:
                block = self.bring_back(pool, hashes, index)
                if block is None:
                    hits = None
                    break
            hits.append(block)
        pool.free_blocks(reversed(held))
        return hits

    def bring_back(
        self, pool: BlockPool, hashes: Sequence[BlockHash], index: int
    ) -> KVCacheBlock | None:
        """The tier's block under hashes[index], cached in a block the pool takes from its
        free head (its bytes copied in before the next step), or None: the tier lacks it
        (or its copy is torn) or the pool has no free block."""
        if hashes[index] not in self.tier or not pool.free_block_queue:
            return None
        data = self.tier.get(hashes[index])  # None: torn (dropped)
        if data is None:
            return None
        block = pool.adopt(hashes, index)
        self._loads[block.block_id] = (hashes[index], data)
        return block

    def take(self) -> tuple[list[tuple[int, BlockHash]], dict[int, bytes]]:
        """What the engine must do before the step it is about to run, and forget it:
        (evicted blocks to copy into the tier under their hash, the bytes of blocks
        brought back to write into them). Copy the evicted ones out before writing the
        others in: a block can be both."""
        offloads, self._offloads = self._offloads, []
        loads, self._loads = self._loads, {}
        return offloads, {block_id: data for block_id, (_, data) in loads.items()}
