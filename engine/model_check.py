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
    linear = _linear_layers(config, layers)
    if linear:  # Qwen3.5: gated q (each head's q and gate), linear-attention layers
        sizes = ((2 * q, hidden), *sizes[1:])
    sparse = _sparse_layers(config, layers)
    for layer in range(layers):
        if layer in sparse:
            expected.update(_expert_sizes(config, layer, hidden, shapes, positive, fail))
        if layer in linear:
            expected.update(_linear_sizes(config, layer, hidden, positive))
            for projection, size in zip(_PROJECTIONS[4:], sizes[4:], strict=True):
                expected[f"model.layers.{layer}.{projection}.weight"] = size
            continue
        for projection, size in zip(_PROJECTIONS, sizes, strict=True):
            if not (layer in sparse and projection.startswith("mlp.")):
                expected[f"model.layers.{layer}.{projection}.weight"] = size
        for projection, size in fused.items():  # a checkpoint that stores them fused (Phi-3)
            name = f"model.layers.{layer}.{projection}.weight"
            if name in shapes and not (layer in sparse and projection.startswith("mlp.")):
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


def _linear_layers(config: Any, layers: int) -> set[int]:
    """The linear-attention layers (Qwen3.5's `layer_types`, or its every-4th-full rule)."""
    if getattr(config, "model_type", None) != "qwen3_5_text":
        return set()
    types = getattr(config, "layer_types", None)
    if not types:
        every = getattr(config, "full_attention_interval", 4)
        return {i for i in range(layers) if (i + 1) % every}
    if len(types) != layers:
        raise ValueError(f"the config's layer_types has {len(types)} entries for {layers} layers")
    return {i for i, kind in enumerate(types) if kind == "linear_attention"}


def _linear_sizes(config: Any, layer: int, hidden: int, positive: Any) -> dict[str, tuple]:
    """A Gated DeltaNet layer's tensors and the shapes its config needs."""
    key_dim = positive("linear_num_key_heads") * positive("linear_key_head_dim")
    v_heads = positive("linear_num_value_heads")
    value_dim = v_heads * positive("linear_value_head_dim")
    conv, kernel = 2 * key_dim + value_dim, positive("linear_conv_kernel_dim")
    p = f"model.layers.{layer}.linear_attn."
    return {p + "in_proj_qkv.weight": (conv, hidden), p + "in_proj_z.weight": (value_dim, hidden),
            p + "in_proj_b.weight": (v_heads, hidden), p + "in_proj_a.weight": (v_heads, hidden),
            p + "out_proj.weight": (hidden, value_dim), p + "conv1d.weight": (conv, 1, kernel)}  # fmt: skip


def _sparse_layers(config: Any, layers: int) -> frozenset[int]:
    """The layers whose MLP is a mixture of experts (a config with `num_experts`)."""
    if not isinstance(getattr(config, "num_experts", None), int):
        return frozenset()
    from engine.models.moe import MoESpec  # (torch: only for a mixture of experts)

    return MoESpec.of(config).layers


def _expert_sizes(config: Any, layer: int, hidden: int, shapes: Mapping[str, tuple[int, ...]],
                  positive: Any, fail: Any) -> dict[str, tuple[int, ...]]:  # fmt: skip
    """A mixture of experts' tensors and the shapes its config needs; the router's first,
    so that a crafted expert count is refused before it is counted out. gpt-oss names its
    router ``router`` (with a bias) and biases every projection; its Hugging Face checkpoints
    keep each projection of all experts in one tensor (its GGUFs: one per expert, as read)."""
    gpt_oss = getattr(config, "model_type", None) == "gpt_oss"
    experts = positive("num_experts")
    inter = positive("intermediate_size" if gpt_oss else "moe_intermediate_size")
    if positive("num_experts_per_tok") > experts:
        raise fail(f"num_experts_per_tok is over num_experts ({experts})")
    p = f"model.layers.{layer}.mlp."
    router = p + ("router.weight" if gpt_oss else "gate.weight")
    stacked = gpt_oss and p + "experts.gate_up_proj" in shapes
    if shapes.get(router) != (experts, hidden):
        raise fail(f"{router} is {_shape(shapes.get(router))}, the config needs "
                   f"{[experts, hidden]}")  # fmt: skip
    sizes: dict[str, tuple[int, ...]] = {router: (experts, hidden)}
    if stacked:
        x = p + "experts."
        return sizes | {p + "router.bias": (experts,),
                        x + "gate_up_proj": (experts, hidden, 2 * inter),
                        x + "gate_up_proj_bias": (experts, 2 * inter),
                        x + "down_proj": (experts, inter, hidden),
                        x + "down_proj_bias": (experts, hidden)}  # fmt: skip
    if gpt_oss:
        sizes[p + "router.bias"] = (experts,)
    for e in range(experts):
        x = f"{p}experts.{e}."
        sizes |= {x + "gate_proj.weight": (inter, hidden), x + "up_proj.weight": (inter, hidden),
                  x + "down_proj.weight": (hidden, inter)}  # fmt: skip
        if gpt_oss:
            sizes |= {x + "gate_proj.bias": (inter,), x + "up_proj.bias": (inter,),
                      x + "down_proj.bias": (hidden,)}  # fmt: skip
    return sizes
