"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms) with a mixture
of experts in place of the dense MLP (engine/models/moe.py): 128 experts, 8 a token, no
shared expert. Every layer is sparse but those `mlp_only_layers` names and the ones
`decoder_sparse_step` skips, which keep a dense MLP of `intermediate_size`."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.models.layers import Architecture
from engine.models.moe import MoESpec
from engine.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def architecture(cls, hf_config: Any) -> Architecture:
        return dataclasses.replace(super().architecture(hf_config), moe=MoESpec.of(hf_config))
