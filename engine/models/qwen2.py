"""Qwen2: Llama with a bias on q, k and v (none on o), and a sliding window only where the
config turns it on (`use_sliding_window`), then on the layers from `max_window_layers` on
(or as the config's `layer_types` say), as transformers' Qwen2Config decides."""

from __future__ import annotations

from typing import Any

from engine.models.llama import LlamaForCausalLM, opted_in_window

MAX_WINDOW_LAYERS = 28  # transformers' default


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_biases = (True, False)

    @classmethod
    def sliding_window(cls, hf_config: Any) -> int | None:
        return opted_in_window(hf_config)

    @classmethod
    def layer_types(cls, hf_config: Any) -> tuple[str, ...]:
        if cls.sliding_window(hf_config) is None:
            return ()
        types = getattr(hf_config, "layer_types", None)
        if types:
            return tuple(types)
        first = getattr(hf_config, "max_window_layers", MAX_WINDOW_LAYERS)
        return tuple("sliding_attention" if i >= first else "full_attention"
                     for i in range(hf_config.num_hidden_layers))  # fmt: skip
