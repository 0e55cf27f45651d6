"""Which of our model classes serves a transformers architecture name."""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.models.llama import LlamaForCausalLM

# Mistral and Qwen2 are Llama with small switches (Qwen2: q/k/v bias; both: a
# sliding window we do not apply, see engine/models/llama.py).
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}

_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """Our class for ``hf_config.architectures`` (or its ``model_type``); ValueError if unsupported."""
    names = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    if not names and model_type in _MODEL_TYPES:
        names = [_MODEL_TYPES[model_type]]
    for name in names:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    supported = ", ".join(sorted(MODEL_REGISTRY))
    shown = ", ".join(names) or f"model_type={model_type!r}"
    raise ValueError(f"unsupported model architecture {shown}; supported: {supported}")
