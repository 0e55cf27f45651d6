"""The one list of architectures the engine serves, and the class that serves each.

Lazy, as vLLM's registry is: the table names modules, so the loader can check a config's
architecture (engine/loader.py) without importing torch models; `get_model_class` imports
the one it needs.
"""

from __future__ import annotations

import importlib
from typing import Any

# transformers' architecture name -> (its model_type, our module); the class has the same
# name as the architecture.
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "engine.models.llama"),
    "Qwen2ForCausalLM": ("qwen2", "engine.models.qwen2"),
    "MistralForCausalLM": ("mistral", "engine.models.mistral"),
    "Qwen3ForCausalLM": ("qwen3", "engine.models.qwen3"),
    "Gemma3ForCausalLM": ("gemma3_text", "engine.models.gemma3"),
    "SmolLM3ForCausalLM": ("smollm3", "engine.models.smollm3"),
    "Phi3ForCausalLM": ("phi3", "engine.models.phi3"),
    "Qwen3_5ForCausalLM": ("qwen3_5_text", "engine.models.qwen3_5"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "engine.models.qwen3_moe"),
    "GptOssForCausalLM": ("gpt_oss", "engine.models.gpt_oss"),
}
ARCHITECTURE_BY_MODEL_TYPE = {model_type: name for name, (model_type, _) in ARCHITECTURES.items()}


def architectures_of(hf_config: Any) -> list[str]:
    """The config's architecture names, or the one its model_type implies."""
    names = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    if not names and model_type in ARCHITECTURE_BY_MODEL_TYPE:
        names = [ARCHITECTURE_BY_MODEL_TYPE[model_type]]
    return names


def get_model_class(hf_config: Any) -> type:
    """Our class for ``hf_config.architectures`` (or its ``model_type``); ValueError if unsupported."""
    names = architectures_of(hf_config)
    for name in names:
        if name in ARCHITECTURES:
            return getattr(importlib.import_module(ARCHITECTURES[name][1]), name)
    supported = ", ".join(sorted(ARCHITECTURES))
    shown = ", ".join(names) or f"model_type={getattr(hf_config, 'model_type', None)!r}"
    raise ValueError(f"unsupported model architecture {shown}; supported: {supported}")
