"""gpt-oss (gpt-oss-20b, gpt-oss-120b): Llama's layer with a mixture of experts in place of
every MLP (engine/models/moe.py: 32 or 128 experts, 4 a token, biased router and experts,
the softmax over the top-k logits, a clamped SwiGLU), q/k/v/o biases, attention sinks (a
learned logit per head in each softmax, engine/attention/sinks.py), sliding-window layers
(128 tokens) alternating with full ones, and YaRN rotary (transformers' tables).

transformers keeps every expert of a layer in one tensor (`experts.gate_up_proj`, gate and
up interleaved by column); engine/models/weight_loading.py splits it into the experts'
own projections.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.models.layers import Architecture
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import MoESpec


class GptOssForCausalLM(LlamaForCausalLM):
    @classmethod
    def architecture(cls, hf_config: Any) -> Architecture:
        arch = super().architecture(hf_config)
        return dataclasses.replace(arch, moe=MoESpec.of(hf_config), attn_sinks=True)

    @classmethod
    def layer_types(cls, hf_config: Any) -> tuple[str, ...]:
        """The config's, or as transformers derives them: sliding, full, sliding, ..."""
        given = getattr(hf_config, "layer_types", None)
        if given:
            return tuple(given)
        return tuple("sliding_attention" if (i + 1) % 2 else "full_attention"
                     for i in range(hf_config.num_hidden_layers))  # fmt: skip
