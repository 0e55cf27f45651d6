"""A model's hyperparameters checked against the weights it ships, before the model is built.

The model, its rotary tables and its KV cache are sized from the config (a GGUF's metadata
or a config.json) before any weight is read, so a crafted or broken value (a billion
layers, a context of 2^60, a vocabulary the embedding does not hold) would allocate or loop
past anything the file backs. Every size the model allocates by must therefore agree with
the shape of a tensor in the checkpoint, whose extent the readers have already checked
against the file (`engine.gguf_file`, safetensors' own header checks).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.errors import ModelFileError

MAX_CONTEXT_LENGTH = 2**24  # 16M positions: more than any released model
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def check_config(config: Any, shapes: Mapping[str, tuple[int, ...]], source: str | Path) -> None:
    """`ModelFileError` naming ``source`` and the first size of ``config`` (a `ModelConfig`
    or transformers' config) that ``shapes`` (the checkpoint's tensors under transformers'
    names) contradict."""

    def fail(what: str) -> ModelFileError:
        return ModelFileError(f"{source}: {what}")

    def positive(name: str, default: int | None = None) -> int:
        value = getattr(config, name, None)
        value = default if value is None and default is not None else value
        if type(value) is not int or value < 1:
            raise fail(f"the config's {name} is {value!r}, not a positive integer")
        return value

    layers, hidden = positive("num_hidden_layers"), positive("hidden_size")
    heads, vocab = positive("num_attention_heads"), positive("vocab_size")
    kv_heads = positive("num_key_value_heads", heads)
    head_dim, ffn = positive("head_dim", hidden // heads or 1), positive("intermediate_size")
    context = positive("max_position_embeddings")
    if heads % kv_heads:
        raise fail(f"num_attention_heads {heads} is not a multiple of num_key_value_heads "
                   f"{kv_heads}")  # fmt: skip
    if context > MAX_CONTEXT_LENGTH:
        raise fail(f"max_position_embeddings is {context:,}, over the "
                   f"{MAX_CONTEXT_LENGTH:,} positions this server supports")  # fmt: skip
    found = {int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    if layers != len(found) or found != set(range(layers)):  # (no set of a crafted size)
        raise fail(f"the config says {layers:,} layers, the weights hold {len(found):,}")
    expected = {"model.embed_tokens.weight": (vocab, hidden)}
    if "lm_head.weight" in shapes:
        expected["lm_head.weight"] = (vocab, hidden)
    q, kv = heads * head_dim, kv_heads * head_dim
    sizes = ((q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (ffn, hidden), (ffn, hidden),
             (hidden, ffn))  # fmt: skip
    fused = {"self_attn.qkv_proj": (q + 2 * kv, hidden), "mlp.gate_up_proj": (2 * ffn, hidden)}
    for layer in range(layers):
        for projection, size in zip(_PROJECTIONS, sizes, strict=True):
            expected[f"model.layers.{layer}.{projection}.weight"] = size
        for projection, size in fused.items():  # a checkpoint that stores them fused (Phi-3)
            name = f"model.layers.{layer}.{projection}.weight"
            if name in shapes:
                parts = (
                    _PROJECTIONS[:3] if projection.startswith("self_attn") else _PROJECTIONS[4:6]
                )
                for part in parts:
                    del expected[f"model.layers.{layer}.{part}.weight"]
                expected[name] = size
    for name, size in expected.items():
        if shapes.get(name) != size:
            raise fail(f"{name} is {_shape(shapes.get(name))}, the config needs {list(size)}")


def _shape(shape: tuple[int, ...] | None) -> str:
    return "missing" if shape is None else str(list(shape))
