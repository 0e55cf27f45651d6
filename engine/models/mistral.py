"""Mistral: Llama's layers; its sliding window is not applied, so the engine caps the
context at the window, where full attention equals it (engine/resolved_config.py)."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
