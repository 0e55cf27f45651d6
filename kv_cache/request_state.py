"""What the KV cache manager remembers of one request (`RequestState`), and what it reads
of the scheduler's requests (`RequestLike`)."""

from __future__ import annotations

from typing import Protocol

from kv_cache.block import BlockHash


class RequestLike(Protocol):
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    extra_keys: tuple


# A block-table entry a sliding window no longer reads (its block was given back). Any block
# id would do, as attention never reads it; 0 keeps the table a valid index everywhere.
SKIPPED = 0


class RequestState:
    """What the manager remembers about one request."""

    __slots__ = (
        "block_ids",
        "num_skipped",
        "block_hashes",
        "num_cached_blocks",
        "extra",
        "pending_lookup",
    )

    def __init__(self, extra: object) -> None:
        # The block table, append-only; the blocks themselves are the pool's.
        self.block_ids: tuple[int, ...] = ()
        # block_ids[:num_skipped] are `SKIPPED` (sliding window): they hold no block.
        self.num_skipped = 0
        # Hashes of the request's full blocks of known tokens, computed once
        # and extended as the request grows.
        self.block_hashes: list[BlockHash] = []
        # block_ids[:num_cached_blocks] have been offered to the cache.
        self.num_cached_blocks = 0
        self.extra = extra  # extra_keys in the hasher's per-request form
        # (tokens looked up, hit tokens) of the last lookup, counted in the
        # stats once the allocation that follows it succeeds: a request that
        # waits several steps for blocks is looked up, but counted, once.
        self.pending_lookup: tuple[int, int] | None = None
