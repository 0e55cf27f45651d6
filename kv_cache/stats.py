"""Prefix-cache counters, in tokens."""

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

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        self.requests = self.queries = self.hits = 0
