"""A picture of the block pool at one moment: each block's state, and the prefixes that
hold the most blocks (what the dashboard draws).

Taken on the thread that owns the pool, between steps. Its cost is one pass over the
blocks in a list comprehension plus one over the request tables (about 7 ms for a full
100,000-block pool on a slow core): the per-prefix counts are the pool's own
(`BlockPool.root_num_cached`), kept as blocks are cached and evicted.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from operator import itemgetter

from kv_cache.block import BlockHash
from kv_cache.block_pool import BlockPool
from kv_cache.stats import BlockCounts

# One character per block in `PoolSnapshot.block_states`.
FREE, CACHED, IN_USE = "f", "c", "u"
# Per block: 0 = free, 1 = cached (free, with a hash), 2 = in use -> its character.
_STATE_CHARS = bytes.maketrans(b"\x00\x01\x02", (FREE + CACHED + IN_USE).encode())


@dataclass(frozen=True, slots=True)
class PrefixGroup:
    """The blocks of the chains that start with one first block: a shared prefix's cached
    blocks and the not-yet-cached blocks of the requests that extend it."""

    first_block_id: int | None  # None once the chain's first block was evicted
    num_blocks: int  # cached (free or held) and in-use blocks of the group
    num_requests: int  # requests holding blocks of it now
    # The first tokens of the first block (`BlockPool.root_tokens`); () when they are not
    # kept: a salted request's, a first block that is not full yet or was evicted.
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    block_states: str  # block i's state is block_states[i]: FREE, CACHED or IN_USE
    counts: BlockCounts
    prefixes: tuple[PrefixGroup, ...]  # most blocks first


# A request table as the manager hands it over: (block ids, hash of its first block or None).
RequestTable = tuple[Sequence[int], BlockHash | None]


def take_snapshot(
    pool: BlockPool,
    tables: Sequence[RequestTable],
    max_prefixes: int,
    counts: BlockCounts | None = None,  # the manager's, with its groups' (else the pool's)
) -> PoolSnapshot:
    blocks = pool.blocks
    codes = bytes([2 if b.ref_cnt else b.block_hash is not None for b in blocks])
    group_blocks: dict[Hashable, int] = dict(pool.root_num_cached)
    group_requests: Counter[Hashable] = Counter()
    first_blocks: dict[Hashable, int] = {}
    for block_ids, root_hash in tables:
        # A request with no full block yet has a prefix of its own.
        key: Hashable = root_hash if root_hash is not None else ("request", block_ids[0])
        group_requests[key] += 1
        first_blocks.setdefault(key, block_ids[0])
        # Its blocks without a hash (the last, partial one; a duplicate) are its alone.
        own = sum(1 for block_id in block_ids if blocks[block_id].block_hash is None)
        if own:
            group_blocks[key] = group_blocks.get(key, 0) + own
    prefixes = []
    for key, num_blocks in heapq.nlargest(max_prefixes, group_blocks.items(), key=itemgetter(1)):
        first = None if isinstance(key, tuple) else pool.cached_hash_to_block.get(key)
        prefixes.append(
            PrefixGroup(
                first_block_id=first.block_id if first is not None else first_blocks.get(key),
                num_blocks=num_blocks,
                num_requests=group_requests[key],
                token_ids=() if isinstance(key, tuple) else pool.root_tokens.get(key, ()),
            )
        )
    states = codes.translate(_STATE_CHARS).decode("ascii")
    return PoolSnapshot(states, counts or pool.block_counts(), tuple(prefixes))
