"""Mistral: Llama's layers, every one over the config's `sliding_window` when it has one
(Mistral v0.1: 4,096 tokens; later versions: none)."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
