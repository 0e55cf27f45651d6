"""Model implementations over the paged KV cache."""

from engine.models.llama import LlamaForCausalLM
from engine.models.registry import MODEL_REGISTRY, get_model_class

__all__ = ["LlamaForCausalLM", "MODEL_REGISTRY", "get_model_class"]
