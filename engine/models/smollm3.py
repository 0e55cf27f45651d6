"""SmolLM3: Llama's layers, of which every ``no_rope_layer_interval``-th (or those
``no_rope_layers`` marks 0) applies no rotary ("NoPE" layers: their table rotates by angle
0); sliding-window layers only where the config turns them on, and then only on the layers
with rotary, as transformers' SmolLM3Config derives them."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.models.layers import Architecture
from engine.models.llama import LlamaForCausalLM, opted_in_window


class SmolLM3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def sliding_window(cls, hf_config: Any) -> int | None:
        return opted_in_window(hf_config)

    @classmethod
    def architecture(cls, hf_config: Any) -> Architecture:
        rope = tuple("default" if use else "none" for use in cls._uses_rope(hf_config))
        return dataclasses.replace(super().architecture(hf_config), layer_rope=rope)

    @classmethod
    def layer_types(cls, hf_config: Any) -> tuple[str, ...]:
        given = getattr(hf_config, "layer_types", None)
        if given:
            return tuple(given)
        window = cls.sliding_window(hf_config)
        return tuple("sliding_attention" if window is not None and not use else "full_attention"
                     for use in cls._uses_rope(hf_config))  # fmt: skip

    @staticmethod
    def _uses_rope(hf_config: Any) -> list[int]:
        """Per layer, 1 where it applies rotary (transformers' ``no_rope_layers``)."""
        given = getattr(hf_config, "no_rope_layers", None)
        if given:
            return list(given)
        interval = getattr(hf_config, "no_rope_layer_interval", 4)
        return [int((i + 1) % interval != 0) for i in range(hf_config.num_hidden_layers)]
