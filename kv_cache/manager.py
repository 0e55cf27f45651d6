"""KVCacheManager: per-request block tables on top of the block pool.

The manager is the one owner of each request's block table (`get_block_ids`): a
tuple of block ids, replaced (never mutated) as blocks are added, so the scheduler
hands it to the model runner as it is and no reader ever sees it change.

The scheduler's calls, per step:
- new (or resumed) request: `hits, n = get_computed_blocks(req)`, then
  `allocate_slots(req, num_new_tokens, hits)` with req.num_computed_tokens
  still 0; on success the caller advances num_computed_tokens by
  n + num_new_tokens.
- running request: `allocate_slots(req, num_new_tokens)` (decode: 1, after
  the sampled token was appended to all_token_ids).
- speculative decode: `allocate_slots(req, 1 + k)` for the last token and k draft
  tokens (not in all_token_ids, so never hashed); after verification the caller sets
  num_computed_tokens to what was kept and calls `trim(req)` to free the rejected tail.
- request leaves (finished, aborted, preempted): `free(req)`. Call it for a
  waiting request that was looked up too: the manager keeps its block hashes
  between the lookup and the allocation (so a request that keeps failing to
  get blocks is not rehashed every step) and only `free` drops them.

`req` is any object with request_id, all_token_ids, num_computed_tokens and
extra_keys. Requests are keyed by request_id.

A manager serves one KV cache group (kv_cache/groups.py): layers of one attention kind.
Under a sliding window of W tokens a query at position p reads keys p - W + 1 .. p only,
so `allocate_slots` gives back the blocks that fell out of the window (they stay cached,
for a later request's hit), and `get_computed_blocks` looks for the last W - 1 tokens of
a hit rather than all of them. The table keeps its indexing (block i holds tokens
i*bs .. i*bs + bs - 1): the first `num_skipped` entries are placeholders (`SKIPPED`) that
no kernel reads. A model with several groups has one manager per group over one shared
block pool (kv_cache/hybrid.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kv_cache.block import BlockHash, KVCacheBlock
from kv_cache.block_pool import BlockPool, EventListener
from kv_cache.hashing import get_block_hasher
from kv_cache.host_tier import HostTier
from kv_cache.invariants import check_ref_counts, count_holders
from kv_cache.request_state import SKIPPED, RequestLike, RequestState
from kv_cache.sliding_window import first_block_read, max_blocks_held, window_hit
from kv_cache.snapshot import PoolSnapshot, take_snapshot
from kv_cache.stats import BlockCounts, PrefixCacheStats
from kv_cache.tier_link import TierLink


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "builtin",
        event_listener: EventListener | None = None,
        tier: HostTier | None = None,
        window: int | None = None,
        block_pool: BlockPool | None = None,
        group_key: tuple = (),
        tier_link: TierLink | None = None,
    ) -> None:
        """`window`: the group's sliding window in tokens (None: full attention).
        `block_pool`: a pool shared with the other groups of a model (else its own), and
        `group_key`, which keeps this group's block hashes apart from theirs (the same
        tokens hold other layers' K/V in each group). A shared pool's tier comes as the
        `tier_link` its owner made the pool's listener."""
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if tier_link is not None:
            tier = tier_link.tier
        if tier is not None and (hash_algo != "sha256" or not enable_caching):
            raise ValueError("a second KV tier needs prefix caching with sha256 block hashes")
        if window is not None and window < 1:
            raise ValueError(f"a sliding window must be >= 1 token, got {window}")
        self.window = window
        self.group_key = group_key
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self._hasher = get_block_hasher(hash_algo)
        # The second tier (host_tier.py): what the pool evicts goes there, and a lookup that
        # misses in the pool continues there. The bytes move in the engine, between a
        # schedule() and the step that runs it (`take_tier_moves`).
        self.tier = tier
        if tier_link is None and tier is not None:
            tier_link = TierLink(tier, event_listener)
        self.tier_link = tier_link
        listener = self.tier_link.on_pool_event if self.tier_link else event_listener
        self.block_pool = block_pool or BlockPool(num_blocks, enable_caching, listener)
        # The pool's blocks this group holds (each held block belongs to one group): kept as
        # the free queue shrinks and grows under this manager's calls, so it is O(1).
        self.num_blocks_in_use = 0
        self.stats = PrefixCacheStats()
        self._requests: dict[str, RequestState] = {}
        # Blocks pinned resident (`pin`): each holds one reference for the manager's life.
        self._pinned: list[KVCacheBlock] = []

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.block_pool.free_block_queue)

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def max_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of num_tokens tokens holds at once, computing at most
        max_chunk tokens a step (kv_cache/sliding_window.py)."""
        return max_blocks_held(num_tokens, max_chunk, self.block_size, self.window)

    def _state(self, req: RequestLike) -> RequestState:
        state = self._requests.get(req.request_id)
        if state is None:
            state = RequestState(self._prepare_extra(req))
            self._requests[req.request_id] = state
        return state

    def _prepare_extra(self, req: RequestLike) -> object:
        keys = req.extra_keys + self.group_key if self.group_key else req.extra_keys
        return self._hasher.prepare_extra(keys)

    def get_computed_blocks(
        self, req: RequestLike, max_blocks: int | None = None
    ) -> tuple[list[KVCacheBlock | None], int]:
        """The longest run of cached full blocks at the start of
        req.all_token_ids, and the number of tokens they hold.

        Capped at len(all_token_ids) - 1 tokens: the last token must be
        computed to get logits, so a fully cached prompt gives up its last
        block (and at `max_blocks`, a hit the other groups can serve). With a second
        tier, the run continues with the blocks it brings back (`TierLink.restore`). Under a
        sliding window the hit is the longest prefix whose last blocks (those the next
        token's window reads) are cached; the blocks before them are None.
        """
        if not self.enable_caching:
            return [], 0
        state, hits = self._lookup(req, max_blocks)
        if self.tier_link is not None:
            hits = self._tier_hits(req, state, hits, max_blocks)
        num_hit_tokens = len(hits) * self.block_size
        state.pending_lookup = (len(req.all_token_ids), num_hit_tokens)
        return hits, num_hit_tokens

    def _tier_hits(self, req: RequestLike, state: RequestState, hits: list[KVCacheBlock | None],
                   max_blocks: int | None) -> list[KVCacheBlock | None]:  # fmt: skip
        """The pool's `hits` with what the tier brings back: under full attention the
        blocks that continue them (`TierLink.restore`); under a sliding window the longest
        hit the pool and the tier serve together (`TierLink.lengthen`)."""
        link = self.tier_link
        assert link is not None
        pool, hashes = self.block_pool, state.block_hashes
        if self.window is None:
            restored = link.restore(pool, self.block_size, req, hashes, hits, max_blocks)
            self.stats.tier_hits += len(restored) * self.block_size
            return hits + restored
        hits, num_restored = link.lengthen(
            pool, hashes, hits, lambda lookup: self._lookup(req, max_blocks, lookup)[1]
        )
        self.stats.tier_hits += num_restored * self.block_size
        return hits

    def take_tier_moves(self) -> tuple[list[tuple[int, BlockHash]], dict[int, bytes]]:
        """What the engine must copy before the step it is about to run (`TierLink.take`)."""
        return self.tier_link.take() if self.tier_link is not None else ([], {})

    def cached_blocks(self) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of every block the pool caches (to save them all to the tier)."""
        return [(b.block_id, h) for h, b in self.block_pool.cached_hash_to_block.items()]

    def num_cached_tokens(self, req: RequestLike) -> int:
        """The tokens `get_computed_blocks` would give req now, without keeping the
        lookup (the scheduler ranks waiting requests by it)."""
        if not self.enable_caching:
            return 0
        return len(self._lookup(req)[1]) * self.block_size

    def _lookup(
        self,
        req: RequestLike,
        max_blocks: int | None = None,
        lookup: Callable[[BlockHash], KVCacheBlock | None] | None = None,
    ) -> tuple[RequestState, list[KVCacheBlock | None]]:
        """The request's state and its hit in the pool (through `lookup`, else the pool's
        cached blocks)."""
        state = self._state(req)
        token_ids = req.all_token_ids
        num_tokens = len(token_ids)
        block_size = self.block_size
        hashes = state.block_hashes
        num_full = num_tokens // block_size
        if len(hashes) < num_full:
            self._hasher.extend(hashes, token_ids, block_size, state.extra, num_full)
        lookup = lookup or self.block_pool.cached_hash_to_block.get
        limit = (num_tokens - 1) // block_size
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        if self.window is not None:
            return state, window_hit(lookup, hashes, limit, self.window, block_size)
        hits: list[KVCacheBlock | None] = []
        for i in range(limit):
            block = lookup(hashes[i])
            if block is None:
                break
            hits.append(block)
        return state, hits

    def allocate_slots(
        self,
        req: RequestLike,
        num_new_tokens: int,
        hits: Sequence[KVCacheBlock | None] = (),
    ) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens (after the hits, if any).

        Returns the newly allocated blocks, or None with nothing changed when
        the pool is short (but for the blocks a sliding window gave back, which
        the request never reads again). Blocks that become full of known tokens
        are cached right away, so later requests in the same step can hit them.
        """
        num_needed = self.num_blocks_needed(req, num_new_tokens, hits)
        if num_needed is None or num_needed > len(self.block_pool.free_block_queue):
            return None
        self.take_hits(req, hits)
        return self.allocate_new(req, num_new_tokens, len(hits))

    def num_blocks_needed(
        self, req: RequestLike, num_new_tokens: int, hits: Sequence[KVCacheBlock | None] = ()
    ) -> int:
        """The free blocks `allocate_slots` would take (a hit in the free queue counts as
        one), after giving back what the request's window has passed."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        state = self._requests.get(req.request_id)
        if state is None:
            if hits:
                raise ValueError("hits must come from get_computed_blocks for this request")
            state = RequestState(None)  # nothing known yet: registered by `_allocate`
        block_size = self.block_size
        num_hits = len(hits)
        if self.window is not None and state.block_ids:
            self._skip_passed_blocks(state, req.num_computed_tokens)
        num_tokens = req.num_computed_tokens + num_hits * block_size + num_new_tokens
        num_new_blocks = -(-num_tokens // block_size) - len(state.block_ids) - num_hits
        # Hit blocks with ref_cnt 0 sit in the free queue: touching them uses
        # up free blocks just like allocating does.
        num_needed = max(num_new_blocks, 0)
        if num_hits:
            if not self.enable_caching:
                raise ValueError("hits given but prefix caching is off")
            self._check_hits(state, hits)
            num_needed += sum(1 for block in hits if block is not None and block.ref_cnt == 0)
        return num_needed

    def _skip_passed_blocks(self, state: RequestState, num_computed_tokens: int) -> None:
        """Give back the blocks wholly before the window of the next token to compute
        (position num_computed_tokens): tail first, as `free` does, and still cached."""
        first_read = first_block_read(num_computed_tokens, self.window, self.block_size)
        first_read = min(first_read, len(state.block_ids))
        if first_read <= state.num_skipped:
            return
        blocks = self.block_pool.blocks
        passed = state.block_ids[state.num_skipped : first_read]
        self._release([blocks[i] for i in reversed(passed)])
        state.block_ids = (SKIPPED,) * first_read + state.block_ids[first_read:]
        state.num_skipped = first_read

    def take_hits(self, req: RequestLike, hits: Sequence[KVCacheBlock | None]) -> None:
        """`allocate_slots`' first half, once `num_blocks_needed` said the pool has room:
        the request's hits join its table. Every group of a model takes its hits before
        any takes a new block, which could otherwise evict another group's free hit."""
        state = self._requests.get(req.request_id)
        if state is None:
            state = self._requests[req.request_id] = RequestState(self._prepare_extra(req))
        if state.pending_lookup is not None:
            self._count_lookup(state)
        if hits:
            held = [block for block in hits if block is not None]
            free = len(self.block_pool.free_block_queue)
            self.block_pool.touch(held)
            self.num_blocks_in_use += free - len(self.block_pool.free_block_queue)
            state.num_skipped = len(hits) - len(held)
            state.block_ids += (SKIPPED,) * state.num_skipped
            state.block_ids += tuple([block.block_id for block in held])
            state.num_cached_blocks = len(hits)

    def allocate_new(
        self, req: RequestLike, num_new_tokens: int, num_hits: int = 0
    ) -> list[KVCacheBlock]:
        """`allocate_slots`' second half: blocks for the new tokens after `take_hits` took
        `num_hits` hits (req.num_computed_tokens does not count them yet)."""
        state = self._requests[req.request_id]
        block_size = self.block_size
        pool = self.block_pool
        num_tokens = req.num_computed_tokens + num_hits * block_size + num_new_tokens
        num_new_blocks = -(-num_tokens // block_size) - len(state.block_ids)
        if num_new_blocks > 0:
            new_blocks = pool.get_new_blocks(num_new_blocks)
            self.num_blocks_in_use += num_new_blocks
            state.block_ids += tuple([block.block_id for block in new_blocks])
        else:
            new_blocks = []

        if self.enable_caching:
            token_ids = req.all_token_ids
            # Only blocks whose token ids are all known can be hashed.
            num_full = min(num_tokens, len(token_ids)) // block_size
            if num_full > state.num_cached_blocks:
                # A salted request's prompt is its tenant's: its tokens are never kept for
                # display (`BlockPool.root_tokens`).
                self._cache_blocks(state, token_ids, num_full, show=not req.extra_keys)
        return new_blocks

    def _count_lookup(self, state: RequestState) -> None:
        assert state.pending_lookup is not None
        num_tokens, num_hit_tokens = state.pending_lookup
        state.pending_lookup = None
        stats = self.stats
        stats.requests += 1
        stats.queries += num_tokens
        stats.hits += num_hit_tokens

    def _check_hits(self, state: RequestState, hits: Sequence[KVCacheBlock]) -> None:
        """Reject hits that are not this request's prefix any more, e.g. a hit
        evicted by another allocation between lookup and allocation."""
        if state.block_ids:
            raise ValueError("hits can only be given to a request that holds no blocks yet")
        hashes = state.block_hashes
        if len(hits) > len(hashes):
            raise ValueError("more hits than the request has full blocks")
        for block, block_hash in zip(hits, hashes[: len(hits)], strict=True):
            if block is None:  # before a sliding window's hit: not read
                continue
            if block.block_hash != block_hash:
                raise ValueError(
                    f"stale hit: block {block.block_id} no longer holds this request's prefix; "
                    f"call allocate_slots right after get_computed_blocks"
                )

    def _cache_blocks(
        self, state: RequestState, token_ids: list[int], num_full: int, show: bool = True
    ) -> None:
        hashes = state.block_hashes
        if len(hashes) < num_full:
            self._hasher.extend(hashes, token_ids, self.block_size, state.extra, num_full)
        self.block_pool.cache_full_blocks(
            state.block_ids,
            hashes,
            state.num_cached_blocks,
            num_full,
            token_ids[: self.block_size] if show and state.num_cached_blocks == 0 else None,
        )
        state.num_cached_blocks = num_full

    def uncache_unwritten(self, request_id: str, num_written_tokens: int) -> None:
        """Take out of the prefix cache the blocks the request cached past its first
        `num_written_tokens` tokens, because the step that was to write them failed.
        Blocks are cached when they are allocated, ahead of the step: without this a
        retry of the same prompt would hit KV that was never computed. (Its hit blocks
        all lie before `num_written_tokens`: other requests wrote them.)"""
        state = self._requests.get(request_id)
        if state is None:
            return
        first = max(num_written_tokens // self.block_size, state.num_skipped)
        blocks = self.block_pool.blocks
        for block_id in state.block_ids[first : state.num_cached_blocks]:
            self.block_pool.uncache(blocks[block_id])
        state.num_cached_blocks = min(state.num_cached_blocks, first)

    def free(self, req: RequestLike | str) -> None:
        """Release a request's blocks and forget it (no-op if unknown).

        Tail blocks go to the free queue first: they hash the longest
        prefixes, are the least likely to be reused, so they are evicted first.
        """
        request_id = req if isinstance(req, str) else req.request_id
        state = self._requests.pop(request_id, None)
        if state is not None and state.block_ids:
            blocks = self.block_pool.blocks
            held = state.block_ids[state.num_skipped :]
            self._release([blocks[i] for i in reversed(held)])

    def _release(self, ordered: list[KVCacheBlock]) -> None:
        """`BlockPool.free_blocks`, counting the blocks that no request holds any more."""
        free = len(self.block_pool.free_block_queue)
        self.block_pool.free_blocks(ordered)
        self.num_blocks_in_use -= len(self.block_pool.free_block_queue) - free

    def trim(self, req: RequestLike) -> int:
        """Free the blocks past the ones req.num_computed_tokens need: those a speculative
        step allocated for draft tokens that were rejected. Returns how many were freed."""
        state = self._requests.get(req.request_id)
        if state is None:
            return 0
        keep = max(-(-req.num_computed_tokens // self.block_size), state.num_skipped)
        extra = state.block_ids[keep:]
        if not extra:
            return 0
        state.block_ids = state.block_ids[:keep]
        blocks = self.block_pool.blocks
        self.block_pool.free_unwritten([blocks[i] for i in reversed(extra)])
        self.num_blocks_in_use -= len(extra)  # each had this request as its only holder
        return len(extra)

    def get_block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's block table (never mutated, safe to keep); () for an unknown request."""
        state = self._requests.get(request_id)
        return state.block_ids if state is not None else ()

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The blocks the request holds (a sliding window's passed ones are not held)."""
        state = self._requests.get(request_id)
        if state is None:
            return []
        blocks = self.block_pool.blocks
        return [blocks[i] for i in state.block_ids[state.num_skipped :]]

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be evicted) first."""
        return [block.block_id for block in self.block_pool.free_block_queue]

    def cached_block_ids(self) -> set[int]:
        return {block.block_id for block in self.block_pool.cached_hash_to_block.values()}

    def block_counts(self) -> BlockCounts:
        """Free, cached and in-use blocks (O(1))."""
        return self.block_pool.block_counts()

    def snapshot(self, max_prefixes: int = 10) -> PoolSnapshot:
        """Every block's state and the prefixes holding the most blocks (O(blocks): for a
        dashboard's occasional look, not for every step)."""
        return take_snapshot(self.block_pool, self.held_tables(), max_prefixes)

    def held_tables(self) -> list[tuple[tuple[int, ...], BlockHash | None]]:
        """(the blocks each request holds, its first block's hash), for a snapshot."""
        return [
            (
                state.block_ids[state.num_skipped :],
                state.block_hashes[0] if state.block_hashes else None,
            )
            for state in self._requests.values()
            if len(state.block_ids) > state.num_skipped
        ]

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pinned)

    def pin(self, token_ids: list[int], extra_keys: tuple = ()) -> int:
        """Keep the cached full blocks at the start of token_ids resident for good: each
        takes one more reference, so it never returns to the free queue and LRU never
        evicts it. Pin after the prefix was computed (its blocks cached); returns the
        tokens pinned (whole blocks: a partial last block is not cached)."""
        if not self.enable_caching:
            return 0
        hashes: list[BlockHash] = []
        extra = self._hasher.prepare_extra(extra_keys)
        num_full = len(token_ids) // self.block_size
        self._hasher.extend(hashes, token_ids, self.block_size, extra, num_full)
        lookup = self.block_pool.cached_hash_to_block.get
        matched: list[KVCacheBlock] = []
        for block_hash in hashes:
            block = lookup(block_hash)
            if block is None:
                break
            matched.append(block)
        held = {id(block) for block in self._pinned}
        new = [block for block in matched if id(block) not in held]  # pinned twice: held once
        free = len(self.block_pool.free_block_queue)
        self.block_pool.touch(new)
        self.num_blocks_in_use += free - len(self.block_pool.free_block_queue)
        self._pinned.extend(new)
        return len(matched) * self.block_size

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; False (nothing done) while any is in use (a pinned
        block is in use for good: with pins, a reset is refused)."""
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (tests)."""
        self.block_pool.check_invariants()
        check_ref_counts(self.block_pool, self.count_holders())

    def count_holders(self) -> list[int]:
        """How many of this group's tables and pins hold each block of the pool, checking
        each table on the way (kv_cache/invariants.py)."""
        holders = count_holders(self.block_pool, self._requests, self._pinned, self.window)
        held = sum(1 for n in holders if n)
        if held != self.num_blocks_in_use:
            raise AssertionError(f"{held} blocks are held but the group counts "
                                 f"{self.num_blocks_in_use} in use")  # fmt: skip
        return holders
