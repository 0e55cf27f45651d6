"""Gemma 3's text model (model_type gemma3_text): the shared blocks with Gemma's options:
RMSNorms that scale by (1 + w) in float32, four of them a layer (the attention's and the
MLP's outputs normed before each residual add), q/k norms, a GeGLU MLP (gelu_pytorch_tanh),
the embedding scaled by sqrt(hidden_size) in the model dtype, ``query_pre_attn_scalar`` for
the attention scale, final logit soft-capping, and sliding-window layers interleaved with
full ones, each kind with its own rope parameters (a lower base for the sliding layers).

``attn_logit_softcapping`` is read by transformers' Gemma 3 config but not applied by its
attention, so it is not applied here either.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.models.layers import Architecture
from engine.models.llama import LlamaForCausalLM


class Gemma3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def architecture(cls, hf_config: Any) -> Architecture:
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention is not a causal LM")
        arch = super().architecture(hf_config)  # sizes, biases, layer_types, the window
        softcap = getattr(hf_config, "final_logit_softcapping", None)
        return dataclasses.replace(
            arch,
            act=getattr(hf_config, "hidden_activation", "gelu_pytorch_tanh"),
            mlp_bias=False,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
            qk_norm=True,
            norm_plus_one=True,
            sandwich_norms=True,
            layer_rope=arch.layer_types,  # each kind's own rope parameters
            rotary_dim=arch.head_dim,
            attn_scale=hf_config.query_pre_attn_scalar**-0.5,
            embed_scale=hf_config.hidden_size**0.5,
            final_logit_softcap=None if softcap is None else float(softcap),
        )

    @classmethod
    def layer_types(cls, hf_config: Any) -> tuple[str, ...]:
        """The config's, or as transformers derives them from a config.json of before: every
        ``sliding_window_pattern``-th layer full, the others sliding."""
        given = getattr(hf_config, "layer_types", None)
        if given:
            return tuple(given)
        pattern = getattr(hf_config, "sliding_window_pattern", 6)
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(hf_config.num_hidden_layers))  # fmt: skip
