"""KV cache blocks and the free queue threaded through them.

All blocks are created once, at start-up, by the block pool. The free queue is
a doubly linked list whose links live inside the blocks themselves, so taking
a cached block back out of the middle of the queue (a prefix-cache hit) is
O(1) and no wrapper objects are allocated on the hot path.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

# A block hash: an int for the builtin algorithm, 32 bytes for sha256.
BlockHash = int | bytes


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block of `block_size` KV slots.

    eq=False: blocks are compared by identity (comparing fields would walk the
    linked list); the pointers are left out of repr for the same reason.
    """

    block_id: int
    # Number of request block tables holding this block; 0 means it sits in
    # the free queue (still reusable as a cache hit until it is evicted).
    ref_cnt: int = 0
    # Set when the block becomes full and is cached; cleared on eviction.
    block_hash: BlockHash | None = None
    # The hash of the first block of the chain it was cached in, set and cleared with
    # block_hash: it groups a prefix's blocks (the dashboard) without walking parents.
    # Left out of repr: it only repeats which chain block_hash belongs to.
    root_hash: BlockHash | None = field(default=None, repr=False)
    # Free-queue links; both None exactly when the block is not in the queue.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Blocks with ref_cnt 0 in eviction order: head = least recently freed.

    Two sentinel nodes (block_id -1) sit before the head and after the tail so
    that every real node always has both neighbours and no operation branches
    on "is this the first/last node".
    """

    __slots__ = ("_head", "_tail", "_num_free")

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._num_free

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Head (next to be evicted) first; for inspection, not the hot path."""
        node = self._head.next_free
        tail = self._tail
        while node is not tail:
            assert node is not None
            yield node
            node = node.next_free

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("pop from an empty free block queue")
        assert block is not None and block.next_free is not None
        self._head.next_free = block.next_free
        block.next_free.prev_free = self._head
        block.prev_free = block.next_free = None
        self._num_free -= 1
        return block

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        self._insert_after(last, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put a block at the head: the next one popped (an empty block, worth nothing)."""
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        nxt = prev.next_free
        assert nxt is not None
        prev.next_free = block
        block.prev_free = prev
        block.next_free = nxt
        nxt.prev_free = block
        self._num_free += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._num_free -= 1

    def check_links(self) -> None:
        """Assert the links agree both ways and the length matches (tests)."""
        count = 0
        seen: set[int] = set()
        prev = self._head
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None, "free queue is broken: a next link is None"
            assert node.prev_free is prev, (
                f"free queue links disagree at block {node.block_id}: "
                f"prev_free is not the node that links to it"
            )
            assert node.block_id not in seen, f"block {node.block_id} is in the free queue twice"
            seen.add(node.block_id)
            count += 1
            assert count <= self._num_free, "free queue is longer than its count"
            prev, node = node, node.next_free
        assert self._tail.prev_free is prev, "free queue tail sentinel does not link back"
        assert count == self._num_free, (
            f"free queue holds {count} blocks but counts {self._num_free}"
        )
