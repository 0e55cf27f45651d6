"""Qwen3: Llama with an RMSNorm over each head of q and k (before rotary), no q/k/v bias
(unless the config's `attention_bias` says so), and Qwen2's sliding-window rule: layers
windowed only where the config turns it on (`use_sliding_window`: from `max_window_layers`
on)."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.models.layers import Architecture
from engine.models.qwen2 import Qwen2ForCausalLM


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    attention_biases = None  # the config's attention_bias, as Llama's

    @classmethod
    def architecture(cls, hf_config: Any) -> Architecture:
        return dataclasses.replace(super().architecture(hf_config), qk_norm=True)
