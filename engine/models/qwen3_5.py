"""Qwen3.5's text model (model_type qwen3_5_text; Qwen3-Next has the same layers): three
of every four layers Gated DeltaNet (linear attention keeping a state per request:
engine/models/linear_attention.py), the fourth full attention with q/k norms, rotary on
the first quarter of each head and its output gated by sigmoid of a gate projected with q.
Every RMSNorm scales by (1 + w) in float32 but the linear layers' gated norm, which
scales by w (transformers' Qwen3_5RMSNormGated).

The multimodal checkpoints' rotary (mrope) turns the same angle in its three sections for
text, where every section's position is the token's: plain rotary here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.models.layers import Architecture
from engine.models.linear_attention import LinearAttentionSpec
from engine.models.llama import LlamaForCausalLM


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    @classmethod
    def architecture(cls, hf_config: Any) -> Architecture:
        arch = super().architecture(hf_config)
        linear = LinearAttentionSpec(
            num_k_heads=hf_config.linear_num_key_heads,
            num_v_heads=hf_config.linear_num_value_heads,
            head_k_dim=hf_config.linear_key_head_dim,
            head_v_dim=hf_config.linear_value_head_dim,
            conv_kernel=hf_config.linear_conv_kernel_dim,
        )
        return dataclasses.replace(
            arch, qk_norm=True, norm_plus_one=True, attn_output_gate=True, linear_attention=linear
        )

    @classmethod
    def layer_types(cls, hf_config: Any) -> tuple[str, ...]:
        """The config's, or transformers' rule: every `full_attention_interval`-th layer
        full, the others linear."""
        given = getattr(hf_config, "layer_types", None)
        if given:
            return tuple(given)
        every = getattr(hf_config, "full_attention_interval", 4)
        return tuple("linear_attention" if (i + 1) % every else "full_attention"
                     for i in range(hf_config.num_hidden_layers))  # fmt: skip

    @classmethod
    def sliding_window(cls, hf_config: Any) -> int | None:
        return None
