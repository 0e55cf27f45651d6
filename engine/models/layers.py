"""The shared blocks a decoder model is assembled from: `Architecture` (its numbers and
switches), `Attention` (fused QKV, rotary, paged attention, output projection), `GatedMLP`
(fused gate/up, activation, down) and `DecoderLayer` (pre-norm attention and MLP).

Every layer computes through the op set the execution plan chose (`engine.models.layer_ops`:
torch's, or a native kernels build): one forward, whichever executes it. Under tensor
parallelism each rank holds its share of the heads and MLP columns, and the row-parallel
projections' partial sums are reduced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.distributed import TensorParallel
from engine.models.linear import Linear


@dataclass(frozen=True)
class Architecture:
    """What a decoder's layers are: this rank's share of the heads and MLP columns."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    eps: float
    act: str  # the MLP's activation, by transformers' name
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class _Block(nn.Module):
    def __init__(self, tp: TensorParallel | None) -> None:
        super().__init__()
        self.tp = tp

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output: every rank's partial sum, added up."""
        return partial if self.tp is None else self.tp.all_reduce(partial)


class Attention(_Block):
    """Fused QKV projection, rotary on q and k, the paged cache's attention, output projection."""

    def __init__(self, arch: Architecture, backend: AttentionBackend, tp: TensorParallel | None,
                 **kw: Any) -> None:  # fmt: skip
        super().__init__(tp)
        self.num_heads, self.num_kv_heads = arch.num_heads, arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.scale = self.head_dim**-0.5
        self.backend = backend  # shared by all layers: the runner prepares it once per step
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(arch.hidden_size, qkv_rows, arch.qkv_bias, **kw)
        self.o_proj = Linear(self.num_heads * self.head_dim, arch.hidden_size, arch.o_bias, **kw)

    def forward(self, ops: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                ) -> torch.Tensor:  # fmt: skip
        k_cache, v_cache = kv_cache
        q = ops.rope_write_kv(self.qkv_proj(x), cos, sin, k_cache, v_cache, meta.slot_mapping,
                              self.num_heads, self.num_kv_heads)  # fmt: skip
        out = self.backend(q, k_cache, v_cache, meta, self.scale)
        return self._reduce(self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim)))


class GatedMLP(_Block):
    """``down(act(gate(x)) * up(x))``, gate and up as one projection."""

    def __init__(self, arch: Architecture, tp: TensorParallel | None, **kw: Any) -> None:
        super().__init__(tp)
        self.intermediate_size = arch.intermediate_size
        inter = arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * inter, arch.mlp_bias, **kw)
        self.down_proj = Linear(inter, arch.hidden_size, arch.mlp_bias, **kw)

    def forward(self, ops: Any, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(self.down_proj(ops.silu_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    """Pre-norm attention then MLP, the residual add fused into each norm (see layer_ops)."""

    def __init__(self, arch: Architecture, backend: AttentionBackend, tp: TensorParallel | None,
                 dtype: torch.dtype, device: torch.device, quantization: str | None) -> None:  # fmt: skip
        super().__init__()
        self.eps = arch.eps
        kw = {"dtype": dtype, "device": device}
        self.input_layernorm = _param(arch.hidden_size, **kw)
        self.post_attention_layernorm = _param(arch.hidden_size, **kw)
        self.self_attn = Attention(arch, backend, tp, **kw, quantization=quantization)
        self.mlp = GatedMLP(arch, tp, **kw, quantization=quantization)

    def linears(self) -> tuple[Linear, ...]:
        """The projections in the order the native decode stack takes them."""
        attn, mlp = self.self_attn, self.mlp
        return (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)

    def forward(self, ops: Any, delta: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Takes and returns (the previous block's output, the residual stream before it is
        added); ``cos``/``sin``: ``[T, head_dim]``."""
        x, residual = ops.add_rms_norm(delta, residual, self.input_layernorm, self.eps)
        delta = self.self_attn(ops, x, cos, sin, kv_cache, meta)
        x, residual = ops.add_rms_norm(delta, residual, self.post_attention_layernorm, self.eps)
        return self.mlp(ops, x), residual
