"""KV cache groups: a model's layers sorted by how their K/V is kept.

Layers of one attention kind (full, or a sliding window of W tokens) keep their K/V the
same way, so one block table serves them all; a hybrid model (Gemma 3: five sliding
layers to one full, gpt-oss: one to one) needs a table per kind. As in vLLM's hybrid
allocator, each kind's layers are cut into groups of one size (the smallest kind's
count), and layer j of every group shares the j-th cache tensor: a block id then costs
memory in `group_size` layers, not in all of them, and every group draws from one pool.
A sliding group holds about W / block_size blocks per request however long it runs, so
most of a Gemma 3 model's cache memory goes to its few full layers.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None  # the layers' sliding window in tokens; None: full attention
    layers: tuple[int, ...]  # the model's layer indices, in slot order


def kv_cache_groups(
    layer_windows: Sequence[int | None], state_layers: Collection[int] = ()
) -> tuple[KVCacheGroup, ...]:
    """The groups of a model whose layer i attends a window of layer_windows[i] tokens
    (None: full attention): full-attention groups first, then each window's; one group
    when every layer is of one kind. `state_layers` keep a state, not a KV cache
    (kv_cache/state_group.py): they are in no group."""
    if len(layer_windows) <= len(state_layers):
        raise ValueError("a model needs at least one attention layer")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        if layer in state_layers:
            continue
        if window is not None and window < 1:
            raise ValueError(f"layer {layer}: a sliding window must be >= 1 token, got {window}")
        kinds.setdefault(window, []).append(layer)
    size = min(len(layers) for layers in kinds.values())
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    return tuple(
        KVCacheGroup(window, tuple(kinds[window][i : i + size]))
        for window in order
        for i in range(0, len(kinds[window]), size)
    )


def group_size(groups: Sequence[KVCacheGroup]) -> int:
    """Layers per group (the last group of a kind may have fewer): the cache tensors."""
    return max(len(g.layers) for g in groups)


def layer_slots(groups: Sequence[KVCacheGroup], num_layers: int) -> list[tuple[int, int]]:
    """(group, tensor slot) of each layer; (-1, -1) for a layer in no group (a state's)."""
    where = [(-1, -1)] * num_layers
    for g, group in enumerate(groups):
        for slot, layer in enumerate(group.layers):
            where[layer] = (g, slot)
    return where
