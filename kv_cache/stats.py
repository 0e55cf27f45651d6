"""Prefix-cache counters, in tokens, and the block pool's counts by state."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    # Admissions that looked up the cache first (get_computed_blocks followed
    # by a successful allocate_slots), with caching on. Lookups whose
    # allocation fails are not counted (the request is looked up again next
    # step); a preempted request that is resumed counts again.
    requests: int = 0
    # Prompt tokens looked up (len(all_token_ids) at lookup time).
    queries: int = 0
    # Tokens served from the cache (whole hit blocks).
    hits: int = 0
    # Tokens brought back from the second tier into the pool (then served as hits).
    tier_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        self.requests = self.queries = self.hits = self.tier_hits = 0


@dataclass(frozen=True, slots=True)
class GroupBlocks:
    """The blocks one KV cache group (kv_cache/groups.py) of a hybrid model holds."""

    group: int
    attention: str  # "full", or "sliding_window=W" (W tokens)
    in_use: int


@dataclass(frozen=True, slots=True)
class StateSlots:
    """A state group's slots (kv_cache/state_group.py) by state, as blocks are counted."""

    free: int = 0
    cached: int = 0  # snapshots a hit can copy
    in_use: int = 0  # live states of running requests, and snapshots being written

    @property
    def total(self) -> int:
        return self.free + self.cached + self.in_use


@dataclass(frozen=True, slots=True)
class BlockCounts:
    """The pool's blocks by state; the three states add up to `total`.

    Frozen: the engine thread publishes a new one after each change, and readers on
    other threads (metrics) see either the old or the new one, never half of each.
    """

    free: int = 0  # in the free queue holding nothing reusable (never used, or evicted)
    cached: int = 0  # in the free queue but still holding a reusable prefix (a hit revives it)
    in_use: int = 0  # held by at least one request
    # A hybrid model's in-use blocks by group (they add up to in_use); () for one group.
    groups: tuple[GroupBlocks, ...] = ()
    # A model with recurrent layers: its state slots (not blocks: not in the three above).
    states: StateSlots | None = None

    @property
    def total(self) -> int:
        return self.free + self.cached + self.in_use
