"""Phi-3 and Phi-4-mini: Llama's layers from a checkpoint whose q/k/v and gate/up are
stored fused (`qkv_proj`, `gate_up_proj`: engine/models/weight_loading.py), rotary on the
first ``partial_rotary_factor`` of each head (Phi-4-mini: 0.75), and LongRoPE where the
config asks for it (engine/models/rotary.py: token-exact for sequences up to
``original_max_position_embeddings``, the long factors from there on). Its ``sliding_window``, where set, covers every
layer."""

from __future__ import annotations

from typing import Any

from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    attention_biases = (False, False)

    @classmethod
    def layer_types(cls, hf_config: Any) -> tuple[str, ...]:
        kind = "sliding_attention" if cls.sliding_window(hf_config) else "full_attention"
        return (kind,) * hf_config.num_hidden_layers
