"""Qwen3: Llama with an RMSNorm over each head of q and k (before rotary), no q/k/v bias,
and sliding-window layers only where the config turns them on (`use_sliding_window`: the
layers from `max_window_layers` on)."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.models.layers import Architecture
from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def sliding_window(cls, hf_config: Any) -> int | None:
        if not getattr(hf_config, "use_sliding_window", False):
            return None
        return getattr(hf_config, "sliding_window", None)

    @classmethod
    def architecture(cls, hf_config: Any) -> Architecture:
        return dataclasses.replace(super().architecture(hf_config), qk_norm=True)

    @classmethod
    def layer_types(cls, hf_config: Any) -> tuple[str, ...]:
        given = getattr(hf_config, "layer_types", None)
        if given:
            return tuple(given)
        window = cls.sliding_window(hf_config)
        first = getattr(hf_config, "max_window_layers", 28)
        return tuple("sliding_attention" if window is not None and i >= first else "full_attention"
                     for i in range(hf_config.num_hidden_layers))  # fmt: skip
