"""The block pool: every KV block, the free queue and the prefix-cache map.

Block states:
- in use: ref_cnt > 0, not in the free queue;
- free: ref_cnt == 0, in the free queue exactly once. A free block that still
  has a hash is a cached block that can be revived by a hit (`touch`) until it
  reaches the queue's head and is popped, which evicts it.

A block carries a hash exactly when the map points to it under that hash. When
two requests compute the same block at once (block tables are append-only, so
neither can switch to the other's copy) only the first is cached; the second
stays an anonymous duplicate and disappears when its request is freed.

For watching the pool (metrics, the dashboard) it keeps counts as blocks change, so
no reader walks the pool: the cached free blocks (`block_counts()` is O(1)), the cached
blocks of each chain by its first block's hash (`root_num_cached`), and the first tokens
of each cached chain's first block (`root_tokens`) when the manager hands them over,
so a prefix can be shown as text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kv_cache.block import BlockHash, FreeBlockQueue, KVCacheBlock
from kv_cache.stats import BlockCounts

# Tokens kept of each cached chain's first block (`BlockPool.root_tokens`): enough to
# recognise a prompt, bounded whatever the block size.
ROOT_PREVIEW_TOKENS = 32


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_id: int
    block_hash: BlockHash
    parent_block_hash: BlockHash | None  # None for a sequence's first block


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_id: int
    block_hash: BlockHash


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
EventListener = Callable[[KVCacheEvent], None]


class BlockPool:
    __slots__ = (
        "num_blocks",
        "enable_caching",
        "blocks",
        "free_block_queue",
        "cached_hash_to_block",
        "event_listener",
        "num_cached_free",
        "root_num_cached",
        "root_tokens",
    )

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        event_listener: EventListener | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.event_listener = event_listener
        # Blocks in the free queue that still carry a hash (kept as each block changes).
        self.num_cached_free = 0
        # Root hash -> how many cached blocks (free or held) carry it as their root_hash.
        self.root_num_cached: dict[BlockHash, int] = {}
        # Root hash -> the first tokens of that chain's first block, while it is cached.
        self.root_tokens: dict[BlockHash, tuple[int, ...]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (held by at least one request)."""
        return 1.0 - len(self.free_block_queue) / self.num_blocks

    def block_counts(self) -> BlockCounts:
        """Free, cached and in-use blocks now, in O(1)."""
        num_free = len(self.free_block_queue)
        cached = self.num_cached_free
        return BlockCounts(free=num_free - cached, cached=cached, in_use=self.num_blocks - num_free)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks from the free head (LRU first), evicting cached ones."""
        if num_blocks > len(self.free_block_queue):
            raise ValueError(
                f"cannot get {num_blocks} blocks: only {len(self.free_block_queue)} are free"
            )
        popleft = self.free_block_queue.popleft
        new_blocks = []
        for _ in range(num_blocks):
            block = popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def adopt(self, block_hashes: Sequence[BlockHash], index: int) -> KVCacheBlock:
        """A block that takes block_hashes[index] (block `index` of a chain) for contents the
        caller writes before any reader runs (a block brought back from the second tier):
        taken from the free head as a new block is (evicting what it held), cached, and
        freed to the tail, where the request that wants it finds it."""
        (block,) = self.get_new_blocks(1)
        block_ids = [block.block_id] * (index + 1)  # only position `index` is read
        self.cache_full_blocks(block_ids, block_hashes, index, index + 1)
        self.free_blocks([block])
        return block

    def uncache(self, block: KVCacheBlock) -> None:
        """Take a block out of the prefix cache (it keeps its holders and its place)."""
        if block.block_hash is not None:
            self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        del self.cached_hash_to_block[block_hash]
        if block.ref_cnt == 0:  # get_new_blocks evicts before it takes the block
            self.num_cached_free -= 1
        root_hash = block.root_hash
        assert root_hash is not None
        left = self.root_num_cached[root_hash] - 1
        if left:
            self.root_num_cached[root_hash] = left
        else:
            del self.root_num_cached[root_hash]
        if root_hash == block_hash:
            self.root_tokens.pop(block_hash, None)
        block.block_hash = block.root_hash = None
        if self.event_listener is not None:
            self.event_listener(BlockRemoved(block.block_id, block_hash))

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on hit blocks; a free one leaves the queue so it
        cannot be evicted while in use."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
                if block.block_hash is not None:
                    self.num_cached_free -= 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; those reaching 0 go to the free tail
        in the given order (first given = evicted first)."""
        append = self.free_block_queue.append
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                append(block)
                if block.block_hash is not None:
                    self.num_cached_free += 1

    def free_unwritten(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Give back blocks their only holder allocated but kept nothing in (a speculative
        step's rejected tail): to the free head, so the next allocation takes them
        instead of evicting a cached block."""
        appendleft = self.free_block_queue.appendleft
        for block in blocks:
            if block.ref_cnt != 1 or block.block_hash is not None:
                raise ValueError(f"block {block.block_id} is shared or cached: not unwritten")
            block.ref_cnt = 0
            appendleft(block)

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        """Cache the blocks of block_ids[num_cached_blocks:num_full_blocks] (a request's
        block table), which just became full; block_hashes[i] is the hash of block i.
        `token_ids` (the first block's tokens, or None to keep them unseen) gives the
        chain's first block its preview in `root_tokens` when that block is cached here."""
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        cached = self.cached_hash_to_block
        listener = self.event_listener
        root_hash = block_hashes[0]
        if num_cached_blocks == 0 and token_ids is not None and root_hash not in cached:
            self.root_tokens[root_hash] = tuple(token_ids[:ROOT_PREVIEW_TOKENS])
        num_new = 0
        for i in range(num_cached_blocks, num_full_blocks):
            block_hash = block_hashes[i]
            if block_hash in cached:
                continue  # a duplicate: see the module docstring
            block = self.blocks[block_ids[i]]
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            # Held blocks only (a request's table): num_cached_free does not change.
            block.block_hash = block_hash
            block.root_hash = root_hash
            cached[block_hash] = block
            num_new += 1
            if listener is not None:
                parent = block_hashes[i - 1] if i > 0 else None
                listener(BlockStored(block.block_id, block_hash, parent))
        if num_new:
            self.root_num_cached[root_hash] = self.root_num_cached.get(root_hash, 0) + num_new

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use,
        since a running request may still write into or read from them."""
        if len(self.free_block_queue) != self.num_blocks:
            return False
        for block in self.cached_hash_to_block.values():
            block.block_hash = block.root_hash = None
        self.cached_hash_to_block.clear()
        self.num_cached_free = 0
        self.root_num_cached.clear()
        self.root_tokens.clear()
        if self.event_listener is not None:
            self.event_listener(AllBlocksCleared())
        return True

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (tests)."""
        self.free_block_queue.check_links()
        in_queue = {block.block_id for block in self.free_block_queue}
        num_cached_free = sum(1 for block in self.free_block_queue if block.block_hash is not None)
        if num_cached_free != self.num_cached_free:
            raise AssertionError(
                f"{num_cached_free} free blocks carry a hash but the pool counts "
                f"{self.num_cached_free}"
            )
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            if block.ref_cnt == 0 and block.block_id not in in_queue:
                raise AssertionError(f"block {block.block_id} has ref_cnt 0 but is not free")
            if block.ref_cnt > 0 and block.block_id in in_queue:
                raise AssertionError(
                    f"block {block.block_id} is in use (ref_cnt {block.ref_cnt}) "
                    f"but sits in the free queue"
                )
            if block.block_id not in in_queue and (
                block.prev_free is not None or block.next_free is not None
            ):
                raise AssertionError(f"block {block.block_id} is not free but has queue links")
            if block.block_hash is not None and (
                self.cached_hash_to_block.get(block.block_hash) is not block
            ):
                raise AssertionError(
                    f"block {block.block_id} carries a hash the cache map does not give to it"
                )
            if (block.block_hash is None) != (block.root_hash is None):
                raise AssertionError(
                    f"block {block.block_id}: block_hash and root_hash are not set together"
                )
        for block_hash, block in self.cached_hash_to_block.items():
            if block.block_hash != block_hash:
                raise AssertionError(
                    f"cache map entry points to block {block.block_id}, "
                    f"which carries a different hash"
                )
        by_root: dict[BlockHash, int] = {}
        for block in self.cached_hash_to_block.values():
            assert block.root_hash is not None
            by_root[block.root_hash] = by_root.get(block.root_hash, 0) + 1
        if by_root != self.root_num_cached:
            raise AssertionError("root_num_cached disagrees with the cached blocks' roots")
        for root_hash in self.root_tokens:
            root = self.cached_hash_to_block.get(root_hash)
            if root is None or root.root_hash != root_hash:
                raise AssertionError("root_tokens keeps a chain whose first block left the cache")
        if not self.enable_caching and self.cached_hash_to_block:
            raise AssertionError("caching is off but the cache map is not empty")
