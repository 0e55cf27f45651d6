"""Llama: a decoder of the shared blocks (engine/models/decoder.py) with RMSNorm, rotary
attention with grouped KV heads, and a SwiGLU MLP. Numerically it follows transformers'
implementation, so float32 logits match it to ~1e-5.
"""

from __future__ import annotations

from typing import Any

from engine.models.decoder import DecoderForCausalLM
from engine.models.layers import Architecture
from engine.models.rotary import rotary_dim


def opted_in_window(hf_config: Any) -> int | None:
    """The config's `sliding_window` where `use_sliding_window` turns it on (Qwen2, Qwen3,
    SmolLM3 configs), else None."""
    if not getattr(hf_config, "use_sliding_window", False):
        return None
    return getattr(hf_config, "sliding_window", None)


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
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        layers = hf_config.num_hidden_layers
        return Architecture(
            num_layers=layers,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=hf_config.vocab_size,
            eps=hf_config.rms_norm_eps,
            act=getattr(hf_config, "hidden_act", "silu"),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            layer_types=cls.layer_types(hf_config) or ("full_attention",) * layers,
            sliding_window=cls.sliding_window(hf_config),
            rotary_dim=rotary_dim(hf_config, head_dim),
        )

    @classmethod
    def layer_types(cls, hf_config: Any) -> tuple[str, ...]:
        """Each layer's kind as transformers names it ("full_attention",
        "sliding_attention"); (): every layer full. A config with a `sliding_window`
        (Mistral v0.1) windows every layer, as transformers' Llama-shaped models do."""
        if cls.sliding_window(hf_config) is None:
            return ()
        return ("sliding_attention",) * hf_config.num_hidden_layers
