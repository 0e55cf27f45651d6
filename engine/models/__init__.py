"""Model implementations over the paged KV cache: shared blocks (layers.py, layer_ops.py,
rotary.py, linear.py), the decoder they assemble (decoder.py), one file per architecture
(llama.py, qwen2.py, mistral.py), and the registry of architectures (registry.py, which
imports a model's module only when it is asked for)."""

from engine.models.registry import ARCHITECTURES, get_model_class

__all__ = ["ARCHITECTURES", "get_model_class"]
