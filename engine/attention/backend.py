"""The interface every attention backend implements: plan once per step, attend per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.attention.kv_cache import write_kv
from engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention for the layers of one model (its query and KV head counts).

    The model runner calls `prepare(meta)` once per step, before the first layer: it
    does all of the step's host-side planning (grouping, index and mask tensors).
    Each layer then calls the backend, which does only tensor work on what `prepare`
    made, the same for every layer: a per-layer call free of host-side planning is
    what lets the layer forward be compiled.
    """

    name = ""  # its registry name, set by `get_attention_backend`
    # Whether a decode-only step can be captured in a CUDA graph (engine/cuda_graphs.py):
    # `prepare` of such a step makes no tensor and reads only the batch size and
    # `max_seq_len`, and the layer calls read the step from the metadata's tensors alone.
    cuda_graphs = False

    # Whether the backend attends a sliding window (`window`); one that does not is refused
    # for a windowed layer group by `get_attention_backend`.
    sliding_windows = True
    # Whether it takes attention sinks (engine/attention/sinks.py): built with
    # ``sinks=True``, its call takes each layer's ``sinks``; the plan picks no other for a
    # model that has them.
    attention_sinks = False
    # Which KV cache group's layers the backend serves (its meta: `meta.for_group`).
    kv_group = 0

    def __init__(
        self, num_heads: int, num_kv_heads: int, window: int | None = None, sinks: bool = False
    ) -> None:
        if sinks and not self.attention_sinks:
            raise ValueError(f"the {type(self).__name__} attention backend takes no sinks")
        if num_heads % num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if window is not None and window < 1:
            raise ValueError(f"a sliding window must be >= 1 token, got {window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        # A sliding-window layer's backend: a query at position p attends keys p - window + 1
        # .. p (transformers' sliding mask); None: every key up to p. One backend serves one
        # KV cache group (kv_cache/groups.py), whose layers all have the same window.
        self.window = window
        self.sinks = sinks  # the layers it serves have attention sinks

    def prepare(self, meta: AttentionMetadata) -> None:  # noqa: B027 (optional)
        """Plan the step ``meta`` describes (nothing to plan by default)."""

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store the step's new K/V ``[T, kvh, d]`` at their slots (before the call)."""
        write_kv(k_cache, v_cache, k, v, slot_mapping)

    @abstractmethod
    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of the step's queries ``[T, h, d]`` over the paged cache -> ``[T, h, d]``.

        The step's new K/V are already written (`write_kv`); ``meta`` is the one last
        given to `prepare`.
        """
