"""Attention backends by name, and the one "auto" picks."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from engine.attention.backend import AttentionBackend
from engine.attention.reference import ReferenceBackend
from engine.attention.sdpa import SdpaBackend

# name -> factory of (num_heads, num_kv_heads): each model gets its own backend object,
# since a backend keeps the plan of the step it last prepared.
ATTENTION_BACKENDS: dict[str, Callable[[int, int], AttentionBackend]] = {
    "reference": ReferenceBackend,
    "sdpa": SdpaBackend,
    # Every decode over its whole context, shared prefixes or not: for A/B runs.
    "sdpa-nocascade": partial(SdpaBackend, cascade=False),
}

# "auto" resolves to this; see bench/attention.md for the measurements behind it.
DEFAULT_BACKEND = "sdpa"


def get_attention_backend(name: str, num_heads: int, num_kv_heads: int) -> AttentionBackend:
    """A new backend ``name`` ("auto" = the fastest proven one) for this head layout."""
    key = DEFAULT_BACKEND if name == "auto" else name
    try:
        factory = ATTENTION_BACKENDS[key]
    except KeyError:
        choices = ", ".join(["auto", *ATTENTION_BACKENDS])
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {choices}") from None
    return factory(num_heads, num_kv_heads)
