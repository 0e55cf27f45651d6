"""Scheduler limits: batch size, token budget, context length and the KV pool's shape."""

from __future__ import annotations

from dataclasses import dataclass

from kv_cache.groups import KVCacheGroup
from kv_cache.state_group import StateGroup

PREFIX_CACHE_HASHES = ("builtin", "sha256")
# "fcfs": arrival order, nobody overtakes the head. "lpm": longest cached prefix first,
# one request per uncached shared prefix at a time, arrival order again past the age bound.
SCHEDULING_POLICIES = ("fcfs", "lpm")


def fits_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> bool:
    """The context-length rule: a prompt and up to ``max_tokens`` generated tokens fit in
    ``max_model_len``. The engine and the server refuse a request that breaks it; the
    scheduler alone refuses only a prompt with no room for one output token."""
    return num_prompt_tokens + max_tokens <= max_model_len


@dataclass
class SchedulerConfig:
    # Running requests at most. A budget below it needs no check: a request is only
    # admitted when every running one got a token, so running <= budget anyway.
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # tokens computed per step at most (prefill + decode)
    max_model_len: int = 2048  # prompt + output tokens at most
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 1024  # KV blocks in the pool
    enable_prefix_caching: bool = True
    prefix_cache_hash: str = "builtin"  # "sha256" for multi-tenant safety
    scheduling_policy: str = "fcfs"
    # lpm: a request that has waited longer than this many seconds is admitted in arrival
    # order, before any request the cache would prefer: nothing starves.
    age_bound_s: float = 5.0
    # The model's KV cache groups (kv_cache/groups.py); None: one full-attention group.
    kv_cache_groups: tuple[KVCacheGroup, ...] | None = None
    # The model's recurrent layers' state group (kv_cache/state_group.py); None: none.
    state_group: StateGroup | None = None

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Raise ValueError naming the offending field."""
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "block_size",
            "num_blocks",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        age = self.age_bound_s
        if isinstance(age, bool) or not isinstance(age, int | float) or not 0 <= age < 1e9:
            raise ValueError(f"age_bound_s must be a number of seconds >= 0, got {age!r}")
        if self.prefix_cache_hash not in PREFIX_CACHE_HASHES:
            raise ValueError(
                f"prefix_cache_hash must be one of {PREFIX_CACHE_HASHES}, "
                f"got {self.prefix_cache_hash!r}"
            )
