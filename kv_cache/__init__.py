"""Prefix-caching paged KV cache manager (pure Python: block ids, no tensors)."""

from kv_cache.block import BlockHash, FreeBlockQueue, KVCacheBlock
from kv_cache.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from kv_cache.hashing import HASH_ALGOS, get_block_hasher, hash_block_tokens, hash_request_tokens
from kv_cache.manager import KVCacheManager
from kv_cache.snapshot import PoolSnapshot, PrefixGroup
from kv_cache.stats import BlockCounts, PrefixCacheStats

__all__ = [
    "HASH_ALGOS",
    "AllBlocksCleared",
    "BlockCounts",
    "BlockHash",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheEvent",
    "KVCacheManager",
    "PoolSnapshot",
    "PrefixCacheStats",
    "PrefixGroup",
    "get_block_hasher",
    "hash_block_tokens",
    "hash_request_tokens",
]
