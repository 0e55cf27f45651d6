"""The KV cache manager's invariants, checked by tests after every operation: each
request's table against the pool, and every block's reference count against the tables
(of every KV cache group sharing the pool) and pins that hold it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from kv_cache.block import BlockHash, KVCacheBlock
from kv_cache.block_pool import BlockPool


class _TableState(Protocol):  # what the manager keeps of a request (RequestState)
    block_ids: tuple[int, ...]
    num_skipped: int
    block_hashes: list[BlockHash]
    num_cached_blocks: int


def count_holders(
    pool: BlockPool,
    requests: Mapping[str, _TableState],
    pinned: list[KVCacheBlock],
    window: int | None,
) -> list[int]:
    """How many of one group's tables (`requests`) and pins hold each block of the pool,
    checking each table on the way (AssertionError naming the first broken invariant)."""
    holders = [0] * pool.num_blocks
    for request_id, state in requests.items():
        if not isinstance(state.block_ids, tuple):
            raise AssertionError(f"request {request_id}: block table is not a tuple")
        if state.num_skipped and window is None:
            raise AssertionError(f"request {request_id}: skipped blocks without a window")
        if state.num_skipped > len(state.block_ids):
            raise AssertionError(f"request {request_id}: more skipped blocks than blocks")
        ids = state.block_ids[state.num_skipped :]
        if not all(0 <= i < pool.num_blocks for i in ids):
            raise AssertionError(f"request {request_id} holds a block not in the pool: {ids}")
        if len(set(ids)) != len(ids):
            raise AssertionError(f"request {request_id} holds a block twice: {ids}")
        if state.num_cached_blocks > len(state.block_ids):
            raise AssertionError(f"request {request_id}: more cached blocks than blocks")
        for block_id in ids:
            holders[block_id] += 1
        blocks = [pool.blocks[i] for i in ids]
        num_cached = max(state.num_cached_blocks - state.num_skipped, 0)
        if len(state.block_hashes) < num_cached:
            raise AssertionError(f"request {request_id}: cached blocks without hashes")
        for block in blocks[num_cached:]:
            # Only this request could have cached it, and it has not yet.
            if block.block_hash is not None:
                raise AssertionError(
                    f"request {request_id}: block {block.block_id} is past the "
                    f"request's cached blocks but carries a hash (not evicted?)"
                )
        for block, block_hash in zip(
            blocks[:num_cached],
            state.block_hashes[state.num_skipped : state.num_cached_blocks],
            strict=True,
        ):
            # A held cached block keeps its hash; a duplicate has none.
            if block.block_hash is not None and block.block_hash != block_hash:
                raise AssertionError(
                    f"request {request_id}: block {block.block_id} carries another prefix's hash"
                )
    for block in pinned:
        holders[block.block_id] += 1
        if block.block_hash is None:
            raise AssertionError(f"pinned block {block.block_id} lost its hash")
    return holders


def check_ref_counts(pool: BlockPool, holders: list[int]) -> None:
    """Every block's ref_cnt is the number of tables (of every group) and pins holding it."""
    for block in pool.blocks:
        if block.ref_cnt != holders[block.block_id]:
            raise AssertionError(
                f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                f"{holders[block.block_id]} block tables hold it"
            )
