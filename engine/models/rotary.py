"""Rotary position embedding, computed exactly as transformers computes it.

cos/sin are computed in float32 and cast to the model dtype, and applied as ``q*cos +
rotate_half(q)*sin``, so that float32 logits match transformers' to ~1e-5. Positions at or
past the table's length (``max_position_embeddings`` or the ``max_model_len`` given) are
not supported: "dynamic" rope therefore equals default rope, as in transformers below that
length. Partial rotary (``partial_rotary_factor``: the first dims of each head) is
transformers' Phi-3 arithmetic. A model may hold several tables (`rope_tables`): one per
layer type where the config gives each its own parameters (Gemma 3), and "none" (angle 0:
cos 1, sin 0, exactly the identity) for layers without rotary (SmolLM3).

"longrope" (Phi-3, Phi-4-mini): below ``original_max_position_embeddings`` transformers
rotates by the short factors, and so does this table, token for token. Once a sequence
grows past that length, transformers' Phi-3 drops its cache and recomputes the whole
sequence with the long factors; a paged cache keeps the keys it has, so this table rotates
positions from that length on by the long factors and the ones before stay as they were
computed (what vLLM does): close to transformers there, not token-exact.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.model_config import (
    DEFAULT_PARTIAL_ROTARY,
    DEFAULT_ROPE_SCALING,
    as_transformers_config,
    default_rope_theta,
)


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """Rope settings across transformers versions (``rope_parameters`` in v5, ``rope_scaling``
    before); with ``layer_type``, that layer type's, where the config gives them per type."""
    if layer_type is not None:
        return _layer_type_parameters(config, layer_type)
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None) or {}
    if not params and not legacy:
        params = dict(DEFAULT_ROPE_SCALING.get(getattr(config, "model_type", None), {}))
    for key, value in legacy.items():
        params.setdefault(key, value)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", default_rope_theta(config)))
    return params


def _layer_type_parameters(config: Any, layer_type: str) -> dict[str, Any]:
    """Gemma 3's: ``rope_parameters[layer_type]`` (v5), or from a config.json of before
    (``rope_theta`` and ``rope_scaling`` for full layers, ``rope_local_base_freq`` for sliding
    ones), as transformers' Gemma3TextConfig converts it."""
    given = getattr(config, "rope_parameters", None) or {}
    if layer_type in given:
        params = dict(given[layer_type])
    else:
        full = layer_type == "full_attention"
        params = dict(getattr(config, "rope_scaling", None) or {}) if full else {}
        theta = getattr(config, "rope_theta" if full else "rope_local_base_freq", None)
        if theta is None:
            theta = default_rope_theta(config)["global" if full else "local"]
        params.setdefault("rope_theta", theta)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rotary_dim(config: Any, head_dim: int, layer_type: str | None = None) -> int:
    """The dims of each head that rotate (``partial_rotary_factor`` of them)."""
    params = rope_parameters(config, layer_type)
    default = DEFAULT_PARTIAL_ROTARY.get(getattr(config, "model_type", None), 1.0)
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", default))
    return int(head_dim * factor)


def rope_inv_freq(
    config: Any, head_dim: int, layer_type: str | None = None, long: bool = False
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling factor, computed exactly as transformers
    does (``long``: longrope's long factors)."""
    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = params["rope_theta"]
        dim = rotary_dim(config, head_dim, layer_type)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r}")
    # linear, dynamic (below max_position_embeddings), llama3, yarn, longrope: static
    # frequencies, computed by transformers from its own config object.
    kwargs: dict[str, Any] = {} if layer_type is None else {"layer_type": layer_type}
    if long:
        kwargs["seq_len"] = params["original_max_position_embeddings"] + 1
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](
        as_transformers_config(config), None, **kwargs
    )
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin tables ``[max_positions, rotary_dim]`` in the model dtype, indexed by position:
    of the config's rope (``kind`` "default"), of a layer type's ("full_attention",
    "sliding_attention"), or "none" (cos 1, sin 0: no rotation)."""

    def __init__(self, config: Any, head_dim: int, max_positions: int, dtype, device,
                 kind: str = "default") -> None:  # fmt: skip
        super().__init__()
        if kind == "none":
            self.register_buffer("cos", torch.ones(max_positions, head_dim, dtype=dtype,
                                                   device=device), persistent=False)  # fmt: skip
            self.register_buffer("sin", torch.zeros(max_positions, head_dim, dtype=dtype,
                                                    device=device), persistent=False)  # fmt: skip
            return
        layer_type = None if kind == "default" else kind
        inv_freq, scaling = rope_inv_freq(config, head_dim, layer_type)
        positions = torch.arange(max_positions, dtype=torch.float, device=device)
        freqs = positions[:, None] * inv_freq.to(device)[None, :]
        params = rope_parameters(config, layer_type)
        if params["rope_type"] == "longrope":  # the long factors from the original length on
            start = min(params["original_max_position_embeddings"], max_positions)
            long_inv_freq = rope_inv_freq(config, head_dim, layer_type, long=True)[0]
            freqs[start:] = positions[start:, None] * long_inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape ``[T, rotary_dim]``."""
        return self.cos[positions], self.sin[positions]


def rope_tables(config: Any, kinds: set[str], head_dim: int, max_positions: int, dtype,
                device) -> dict[str, RotaryEmbedding]:  # fmt: skip
    """One `RotaryEmbedding` per kind the layers use (`Architecture.layer_rope`)."""
    return {kind: RotaryEmbedding(config, head_dim, max_positions, dtype, device, kind)
            for kind in sorted(kinds)}  # fmt: skip


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on ``[T, heads, head_dim]`` (cos, sin ``[T, 1, D]``);
    with cos, sin narrower than the head (partial rotary), on its first dims only, as
    transformers' Phi-3 does."""
    if cos.shape[-1] != x.shape[-1]:
        rotary_dim = cos.shape[-1]
        rotated = apply_rotary(x[..., :rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
