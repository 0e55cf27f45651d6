"""Checkpoint tensors (transformers' names) into a decoder model's fused parameters.

q/k/v land in rows of one QKV projection and gate/up in rows of one gate/up projection; a
projection's weight goes through its own loader (`Linear.load`, which keeps GGUF blocks
where its format is served from them), anything else is copied into its parameter. Under
tensor parallelism each rank copies its slice of every full tensor. A GGUF embedding and
head are kept in their blocks where the plan serves them that way (quantization gguf).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.gguf_weights import GGUFTensor
from engine.models.linear import GGUF, Linear, check_shape, weight_rows
from engine.models.moe import SparseMoE

# The model: an engine/models/decoder.py `DecoderForCausalLM` (not imported: it imports this).
DecoderForCausalLM = nn.Module

# transformers' (module, projection) -> (ours, which rows: "q", "k", "v", "gate", "up", or
# None for all of it)
_FUSED = {
    ("self_attn", "q_proj"): ("qkv_proj", "q"),
    ("self_attn", "k_proj"): ("qkv_proj", "k"),
    ("self_attn", "v_proj"): ("qkv_proj", "v"),
    ("self_attn", "o_proj"): ("o_proj", None),
    ("mlp", "gate_proj"): ("gate_up_proj", "gate"),
    ("mlp", "up_proj"): ("gate_up_proj", "up"),
    ("mlp", "down_proj"): ("down_proj", None),
}
# Checkpoints that store them fused already (Phi-3): the whole projection, standing for its parts.
_WHOLE = {("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"),
          ("mlp", "gate_up_proj"): ("gate_proj", "up_proj")}  # fmt: skip
_QK_NORMS = ("q_norm", "k_norm")  # per-head norms of the attention (Qwen3, Gemma 3)
# A linear-attention layer's tensors other than its projections: transformers' name ->
# ours (engine/models/linear_attention.py).
_LINEAR_PARAMS = {"conv1d": "conv_weight", "dt_bias": "dt_bias", "A_log": "A_log",
                  "norm": "norm"}  # fmt: skip
_TOP = {"model.embed_tokens.weight": "embed_tokens", "model.norm.weight": "norm",
        "lm_head.weight": "lm_head"}  # fmt: skip
# gpt-oss' experts, every expert in one tensor ([experts, in, out]: x @ W), biases beside
STACKED_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def load_weights(model: DecoderForCausalLM, weights: Iterable[tuple[str, Any]]) -> set[str]:
    """Copy every tensor of a checkpoint into ``model``; ValueError on an unknown name, a
    shape mismatch, or a parameter left unloaded. Returns the names consumed."""
    loaded: set[str] = set()
    filled: set[tuple[str, str]] = set()
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and model.arch.tie_word_embeddings:
            continue  # tied: the embedding matrix is the head
        if name.rpartition(".")[2] in STACKED_EXPERTS and ".mlp.experts." in name:
            filled.update(_load_stacked_experts(model, name, tensor))
            loaded.add(name)
            continue
        target, rows, shards, linear = _route(model, name)
        try:
            _load_tensor(model, name, tensor, target, rows, linear)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        loaded.add(name)
        filled.update(shards)
    missing = sorted(f"{p}[{s}]" if s else p for p, s in _expected_shards(model) - filled)
    if missing:
        raise ValueError(f"weights missing for: {', '.join(missing[:10])}")
    return loaded


def _load_tensor(model: DecoderForCausalLM, name: str, tensor: Any, target: torch.Tensor,
                 rows: tuple[int, int] | None, linear: Linear | None) -> None:  # fmt: skip
    """One tensor into its place: a projection's weight through its own loader, a GGUF
    embedding or head kept in its blocks, anything else (this rank's part) copied."""
    if linear is not None and model.tp is None:
        linear.load(tensor, rows)
        return
    if _keep_blocks(model, target, tensor):
        return
    if isinstance(tensor, GGUFTensor):
        tensor = tensor.dequantize(torch.float32)
    dest = weight_rows(target, rows)
    tensor = _tp_slice(model, name, tensor)
    check_shape(tensor, dest)
    dest.copy_(tensor.to(device=dest.device, dtype=dest.dtype))


def _keep_blocks(model: DecoderForCausalLM, target: torch.Tensor, tensor: Any) -> bool:
    """Keep a GGUF embedding's or head's blocks as they are (quantization gguf)."""
    keep = isinstance(tensor, GGUFTensor) and model.plan.quantization.head == GGUF and tensor.native
    if keep and target is model.embed_tokens:
        check_shape(tensor, target)
        model.embed_blocks = tensor
        if model.arch.tie_word_embeddings:
            model.head_blocks = tensor
    elif keep and target is model.lm_head:
        check_shape(tensor, target)
        model.head_blocks = tensor
    return keep


def _rows(
    model: DecoderForCausalLM, part: str | None, inter: int | None = None
) -> tuple[int, int] | None:
    """A fused projection's part as (first row, rows), or None: the whole projection
    (``inter``: the MLP's width where not the model's, an expert's)."""
    a = model.arch
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    inter = a.intermediate_size if inter is None else inter
    q *= 2 if a.attn_output_gate else 1  # each head's q rows, then its gate's
    offsets = {None: None, "q": (0, q), "k": (q, kv), "v": (q + kv, kv), "gate": (0, inter),
               "up": (inter, inter)}  # fmt: skip
    return offsets[part]


def _route(
    model: DecoderForCausalLM, name: str
) -> tuple[torch.Tensor, tuple[int, int] | None, list[tuple[str, str]], Linear | None]:
    """A transformers name -> (our tensor, (row offset, rows) or None, the shard keys it
    fills, the `Linear` whose weight it is, which loads it itself, or None)."""
    if name in _TOP:
        return getattr(model, _TOP[name]), None, [(_TOP[name], "")], None
    parts = name.split(".")
    unexpected = ValueError(f"unexpected weight name {name!r}")
    if len(parts) not in (5, 6, 8) or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        raise unexpected
    index = int(parts[2])
    if index >= model.arch.num_layers:
        raise ValueError(f"unexpected weight name {name!r} (layer {index})")
    layer, prefix = model.layers[index], f"layers.{index}."
    if layer.linear_attn is not None and parts[3] == "linear_attn":
        return _route_linear(layer.linear_attn, name, parts[4:], prefix)
    if isinstance(layer.mlp, SparseMoE) and parts[3] == "mlp":
        return _route_experts(model, layer.mlp, name, parts[4:], prefix + "mlp.")
    if len(parts) == 8:
        raise unexpected
    if parts[3:] == ["self_attn", "sinks"] and layer.self_attn is not None:
        if layer.self_attn.sinks is None:
            raise ValueError(f"unexpected weight name {name!r} (this config has no sinks)")
        return layer.self_attn.sinks, None, [(prefix + "self_attn.sinks", "")], None
    if len(parts) == 5:  # model.layers.N.<norm>.weight
        if parts[3] not in layer.norm_names or parts[4] != "weight":
            raise unexpected
        return getattr(layer, parts[3]), None, [(prefix + parts[3], "")], None
    module, proj, kind = parts[3:]
    if module == "self_attn" and layer.self_attn is None:
        raise ValueError(f"unexpected weight name {name!r} (layer {index} is linear attention)")
    if module == "self_attn" and proj in _QK_NORMS and kind == "weight":
        norm = getattr(layer.self_attn, proj)
        if norm is None:
            raise ValueError(f"unexpected weight name {name!r} (this config has no q/k norms)")
        return norm, None, [(prefix + proj, "")], None
    whole = _WHOLE.get((module, proj))
    if ((module, proj) not in _FUSED and whole is None) or kind not in ("weight", "bias"):
        raise unexpected
    ours, part = _FUSED[(module, whole[0])] if whole else _FUSED[(module, proj)]
    part = None if whole else part
    linear = getattr(getattr(layer, module), ours)
    target = getattr(linear, kind)
    if target is None:
        raise ValueError(f"unexpected weight name {name!r} (this config has no such bias)")
    rows = _rows(model, part)
    key = prefix + ours + ("" if kind == "weight" else ".bias")
    keys = [(key, p) for p in whole] if whole else [(key, proj if rows else "")]
    return target, rows, keys, linear if kind == "weight" else None


def _route_linear(
    mixer: Any, name: str, parts: list[str], prefix: str
) -> tuple[torch.Tensor, tuple[int, int] | None, list[tuple[str, str]], Linear | None]:
    """`_route` for a linear-attention layer's tensor (``parts``: after ``linear_attn``)."""
    key = prefix + "linear_attn."
    if len(parts) == 1 and parts[0] in _LINEAR_PARAMS:  # dt_bias, A_log
        ours = _LINEAR_PARAMS[parts[0]]
        return getattr(mixer, ours), None, [(key + ours, "")], None
    if len(parts) != 2 or parts[1] != "weight":
        raise ValueError(f"unexpected weight name {name!r}")
    proj = parts[0]
    if proj in _LINEAR_PARAMS:  # conv1d, norm
        ours = _LINEAR_PARAMS[proj]
        return getattr(mixer, ours), None, [(key + ours, "")], None
    if proj == "out_proj":
        return mixer.out_proj.weight, None, [(key + "out_proj", "")], mixer.out_proj
    rows = mixer.spec.rows().get(proj)
    if rows is None:
        raise ValueError(f"unexpected weight name {name!r}")
    return mixer.in_proj.weight, rows, [(key + "in_proj", proj)], mixer.in_proj


def _route_experts(
    model: DecoderForCausalLM, moe: SparseMoE, name: str, parts: list[str], key: str
) -> tuple[torch.Tensor, tuple[int, int] | None, list[tuple[str, str]], Linear | None]:
    """`_route` for a mixture of experts' tensor (``parts``: after ``mlp``): the router
    (``gate.weight``; gpt-oss' ``router.weight`` and ``router.bias``) or an expert's
    projection (``experts.E.gate_proj.weight``)."""
    if parts in (["gate", "weight"], ["router", "weight"]):
        return moe.gate, None, [(key + "gate", "")], None
    if parts == ["router", "bias"] and moe.gate_bias is not None:
        return moe.gate_bias, None, [(key + "gate.bias", "")], None
    experts = moe.spec.num_experts
    kinds = ("weight", "bias") if moe.spec.bias else ("weight",)
    if (len(parts) != 4 or parts[0] != "experts" or not parts[1].isdigit()
            or int(parts[1]) >= experts or parts[3] not in kinds):  # fmt: skip
        raise ValueError(f"unexpected weight name {name!r} (experts: {experts})")
    proj, kind = parts[2], parts[3]
    if ("mlp", proj) not in _FUSED:
        raise ValueError(f"unexpected weight name {name!r}")
    ours, part = _FUSED[("mlp", proj)]
    linear = getattr(moe.experts[int(parts[1])], ours)
    rows = _rows(model, part, moe.spec.intermediate_size)
    shard = (key + f"experts.{parts[1]}.{ours}" + (".bias" if kind == "bias" else ""),
             proj if rows else "")  # fmt: skip
    return getattr(linear, kind), rows, [shard], linear if kind == "weight" else None


def _load_stacked_experts(
    model: DecoderForCausalLM, name: str, tensor: torch.Tensor
) -> list[tuple[str, str]]:
    """gpt-oss' stacked expert tensor (``model.layers.N.mlp.experts.<STACKED_EXPERTS>``) into
    each expert's projections: weights transposed to ``[out, in]``, and gate/up, which it
    interleaves column by column (gate 0, up 0, gate 1, ...), as the fused projection's gate
    rows then up rows. Returns the shards filled."""
    parts = name.split(".")
    index = int(parts[2]) if len(parts) == 6 and parts[2].isdigit() else -1
    moe = model.layers[index].mlp if 0 <= index < model.arch.num_layers else None
    if not isinstance(moe, SparseMoE) or not moe.spec.bias:
        raise ValueError(f"unexpected weight name {name!r}")
    kind, experts = parts[5], moe.spec.num_experts
    if (
        tensor.dim() != (3 if kind in ("gate_up_proj", "down_proj") else 2)
        or tensor.shape[0] != experts
    ):
        raise ValueError(f"{name}: {list(tensor.shape)} is not [{experts}, ...] as the config says")
    ours = "gate_up_proj" if kind.startswith("gate_up") else "down_proj"
    shards = []
    for e, part in enumerate(tensor):
        linear = getattr(moe.experts[e], ours)
        key = f"layers.{index}.mlp.experts.{e}.{ours}"
        if kind.endswith("_bias"):
            bias = torch.cat((part[0::2], part[1::2])) if ours == "gate_up_proj" else part
            check_shape(bias, linear.bias)
            linear.bias.copy_(bias.to(device=linear.bias.device, dtype=linear.bias.dtype))
            shards += [(f"{key}.bias", p) for p in _EXPERT_PARTS[ours]]
            continue
        weight = part.t()
        if ours == "gate_up_proj":
            weight = torch.cat((weight[0::2], weight[1::2]))
        try:
            linear.load(weight.contiguous(), None)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        shards += [(key, p) for p in _EXPERT_PARTS[ours]]
    return shards


# The shards an expert's projection holds (its rows' parts, as `_expert_shards` counts them)
_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("",)}


def _tp_slice(model: DecoderForCausalLM, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a full checkpoint tensor: rows of the column-parallel projections
    (q, k, v, gate, up: by heads and columns) and of the LM head, columns of the row-parallel
    ones (o, down), whose bias only rank 0 adds (the sum is reduced)."""
    tp = model.tp
    if tp is None:
        return tensor
    if any(f".{module}.{proj}." in name for module, proj in _WHOLE):
        raise ValueError("a checkpoint of fused q/k/v (or gate/up) takes no tensor parallelism")
    column_parallel = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    if any(f".{p}." in name for p in column_parallel) or name == "lm_head.weight":
        return tensor.chunk(tp.size, dim=0)[tp.rank]
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return tensor.chunk(tp.size, dim=1)[tp.rank]
    if name.endswith(("o_proj.bias", "down_proj.bias")) and tp.rank:
        return torch.zeros_like(tensor)
    return tensor


def _expected_shards(model: DecoderForCausalLM) -> set[tuple[str, str]]:
    """Every (parameter, part) a complete checkpoint fills."""
    shards = {("embed_tokens", ""), ("norm", "")}
    if not model.arch.tie_word_embeddings:
        shards.add(("lm_head", ""))
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        shards |= {(p + n, "") for n in layer.norm_names}
        if layer.linear_attn is not None:
            shards |= _linear_shards(layer.linear_attn, p + "linear_attn.")
            shards |= {(p + "gate_up_proj", "gate_proj"), (p + "gate_up_proj", "up_proj"),
                       (p + "down_proj", "")}  # fmt: skip
            continue
        if layer.self_attn.q_norm is not None:
            shards |= {(p + n, "") for n in _QK_NORMS}
        if isinstance(layer.mlp, SparseMoE):
            shards |= _expert_shards(layer.mlp.spec.num_experts, p + "mlp.", layer.mlp.spec.bias)
        if layer.self_attn.sinks is not None:
            shards.add((p + "self_attn.sinks", ""))
        for (module, proj), (ours, part) in _FUSED.items():
            if module == "mlp" and isinstance(layer.mlp, SparseMoE):
                continue
            linear = getattr(getattr(layer, module), ours)
            key = proj if part else ""
            shards.add((p + ours, key))
            if linear.bias is not None:
                shards.add((p + ours + ".bias", key))
    return shards


def _linear_shards(mixer: Any, key: str) -> set[tuple[str, str]]:
    """Every (parameter, part) of a linear-attention layer a checkpoint fills."""
    shards = {(key + ours, "") for ours in _LINEAR_PARAMS.values()}
    shards |= {(key + "in_proj", proj) for proj in mixer.spec.rows()}
    return shards | {(key + "out_proj", "")}


def _expert_shards(experts: int, key: str, bias: bool) -> set[tuple[str, str]]:
    """Every (parameter, part) of a mixture of experts a checkpoint fills (``bias``: the
    router's and every projection's biases too, gpt-oss')."""
    shards = {(key + "gate", "")} | ({(key + "gate.bias", "")} if bias else set())
    for e in range(experts):
        shards |= {(key + f"experts.{e}.gate_up_proj", "gate_proj"),
                   (key + f"experts.{e}.gate_up_proj", "up_proj"),
                   (key + f"experts.{e}.down_proj", "")}  # fmt: skip
        if bias:
            shards |= {(key + f"experts.{e}.gate_up_proj.bias", "gate_proj"),
                       (key + f"experts.{e}.gate_up_proj.bias", "up_proj"),
                       (key + f"experts.{e}.down_proj.bias", "")}  # fmt: skip
    return shards
