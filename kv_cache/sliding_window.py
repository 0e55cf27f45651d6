"""A sliding-window group's arithmetic: which blocks a query still reads, the longest
prefix hit it can serve, and the most blocks a request holds at once.

Under a window of W tokens the query at position p reads keys p - W + 1 .. p (transformers'
sliding mask), so the blocks wholly before that first key are never read again, and a
prefix hit of h tokens needs only the blocks holding keys h - W + 1 .. h - 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kv_cache.block import BlockHash, KVCacheBlock


def first_block_read(position: int, window: int, block_size: int) -> int:
    """The first block the query at `position` reads."""
    return max(0, position - window + 1) // block_size


def window_hit(
    lookup: Callable[[BlockHash], KVCacheBlock | None],
    hashes: Sequence[BlockHash],
    limit: int,
    window: int,
    block_size: int,
) -> list[KVCacheBlock | None]:
    """The longest hit of at most `limit` blocks whose last blocks (those the next token's
    window reads: ceil((W - 1) / bs), at least one) are cached, or whose blocks are all
    cached; None stands for each block before them. Searched from the end, as vLLM's
    sliding-window manager does."""
    need = max(1, -(-(window - 1) // block_size))
    run: list[KVCacheBlock] = []  # cached blocks ending at the candidate's end, reversed
    for i in range(limit - 1, -1, -1):
        block = lookup(hashes[i])
        if block is None:
            run = []
            continue
        run.append(block)
        if len(run) == need or i == 0:
            return [None] * i + run[::-1]
    return []


def max_blocks_held(num_tokens: int, max_chunk: int, block_size: int, window: int | None) -> int:
    """All of a request's blocks, or under a window those of the window before a step's
    first token and of the step's (at most max_chunk) tokens."""
    blocks = -(-num_tokens // block_size)
    if window is None:
        return blocks
    return min(blocks, (window - 1 + max_chunk) // block_size + 2)
