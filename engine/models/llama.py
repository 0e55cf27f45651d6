"""Llama: a decoder of the shared blocks (engine/models/decoder.py) with RMSNorm, rotary
attention with grouped KV heads, and a SwiGLU MLP. Numerically it follows transformers'
implementation, so float32 logits match it to ~1e-5.
"""

from __future__ import annotations

from typing import Any

from engine.models.decoder import DecoderForCausalLM
from engine.models.layers import Architecture


class LlamaForCausalLM(DecoderForCausalLM):
    # (q/k/v bias, o bias) where the config's attention_bias does not say
    attention_biases: tuple[bool, bool] | None = None

    @classmethod
    def architecture(cls, hf_config: Any) -> Architecture:
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        qkv_bias, o_bias = cls.attention_biases or (attention_bias, attention_bias)
        return Architecture(
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            vocab_size=hf_config.vocab_size,
            eps=hf_config.rms_norm_eps,
            act=getattr(hf_config, "hidden_act", "silu"),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        )
