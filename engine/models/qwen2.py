"""Qwen2: Llama with a bias on q, k and v (none on o), and a sliding window only where the
config turns it on (`use_sliding_window`)."""

from __future__ import annotations

from typing import Any

from engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_biases = (True, False)

    @classmethod
    def sliding_window(cls, hf_config: Any) -> int | None:
        if not getattr(hf_config, "use_sliding_window", False):
            return None
        return getattr(hf_config, "sliding_window", None)
