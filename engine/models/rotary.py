"""Rotary position embedding, computed exactly as transformers computes it.

cos/sin are computed in float32 and cast to the model dtype, and applied as ``q*cos +
rotate_half(q)*sin``, so that float32 logits match transformers' to ~1e-5. Positions at or
past the table's length (``max_position_embeddings`` or the ``max_model_len`` given) are
not supported: "dynamic" rope therefore equals default rope, as in transformers below that
length. "longrope" (its frequencies depend on the whole sequence length) and partial rotary
are refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.model_config import as_transformers_config


def _rope_parameters(config: Any) -> dict[str, Any]:
    """Rope settings across transformers versions (``rope_parameters`` in v5, ``rope_scaling`` before)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None) or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def rope_inv_freq(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling factor, computed exactly as transformers does."""
    params = _rope_parameters(config)
    rope_type = params["rope_type"]
    if params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    if rope_type == "longrope":
        raise ValueError("rope_type 'longrope' is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r}")
    # linear, dynamic (below max_position_embeddings), llama3, yarn: static frequencies,
    # computed by transformers from its own config object.
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](
        as_transformers_config(config), None
    )
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin tables ``[max_positions, head_dim]`` in the model dtype, indexed by position."""

    def __init__(self, config: Any, head_dim: int, max_positions: int, dtype, device) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float, device=device)
        freqs = positions[:, None] * inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape ``[T, head_dim]``."""
        return self.cos[positions], self.sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on ``[T, heads, head_dim]`` (cos, sin ``[T, 1, D]``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
