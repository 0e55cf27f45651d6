"""The shared blocks a decoder model is assembled from: `Architecture` (its numbers and
switches), `Attention` (fused QKV, optional q/k norms, rotary, paged attention, output
projection), `GatedMLP` (fused gate/up, activation, down), a mixture of experts in its
place where the architecture names one (`engine/models/moe.py`) and `DecoderLayer`
(pre-norm attention and MLP, optionally Gemma's "sandwich" norms around each).

What differs between families is an option of these blocks, an `Architecture` field each
family file sets once (q/k norms, (1 + w) norms, sandwich norms, per-layer rotary tables,
partial rotary, the attention scale, embedding scale, logit soft-capping); the defaults are
Llama's layer, which the native layer ops and decode stack compute (`layer_ops_misfit`,
`decode_stack_misfit` say why they cannot compute another).

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
from engine.models.linear_attention import GatedDeltaNet, LinearAttentionSpec
from engine.models.moe import MoESpec, SparseMoE


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
    # One per layer, transformers' names: "full_attention", "sliding_attention" (then
    # attending over the last `sliding_window` positions only) or "linear_attention" (a
    # Gated DeltaNet layer, `linear_attention`'s sizes, keeping a state not a KV cache).
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    # -- options of the shared blocks; the defaults are Llama's layer --------------------
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before rotary
    norm_plus_one: bool = False  # every RMSNorm scales by (1 + w), in float32 (Gemma)
    # Gemma's four norms a layer: on the attention's output, before the MLP and on its output
    sandwich_norms: bool = False
    # Each layer's rotary table (engine/models/rotary.py `rope_tables`): "default" (the
    # config's rope), a layer type whose rope parameters the config gives apart (Gemma 3's
    # sliding layers' base), or "none" (no rotary: SmolLM3's NoPE layers); (): all "default".
    layer_rope: tuple[str, ...] = ()
    rotary_dim: int | None = None  # rotary on the first rotary_dim of each head; None: all
    attn_scale: float | None = None  # None: head_dim ** -0.5
    embed_scale: float | None = None  # the embedding rows times this, in the model dtype
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    # The attention's output times sigmoid(gate), the gate projected with q (per head, after
    # its q rows: Qwen3.5's full-attention layers).
    attn_output_gate: bool = False
    # A learned logit per query head that joins every softmax of its attention with no
    # value (gpt-oss' attention sinks): the weights of the real keys sum to less than 1.
    attn_sinks: bool = False
    linear_attention: LinearAttentionSpec | None = None  # the linear layers' sizes
    moe: MoESpec | None = None  # a mixture of experts in the layers it names

    def is_sparse(self, layer: int) -> bool:
        """Whether the layer's MLP is a mixture of experts."""
        return self.moe is not None and layer in self.moe.layers

    def is_linear(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    def rope_of(self, layer: int) -> str:
        return self.layer_rope[layer] if self.layer_rope else "default"

    def layer_ops_misfit(self) -> str | None:
        """Why the native layer ops (Llama's norms, full-width rotary, silu) cannot compute
        this layer, or None. q/k norms and layers without rotary fit: the norms run in
        torch on the fused QKV before the op, a layer without rotary rotates by angle 0."""
        reasons = [
            "(1 + w) norms" if self.norm_plus_one else "",
            "sandwich norms" if self.sandwich_norms else "",
            "partial rotary" if self.rotary_dim not in (None, self.head_dim) else "",
            f"{self.act} MLP" if self.act != "silu" else "",
        ]
        return ", ".join(r for r in reasons if r) or None

    def decode_stack_misfit(self) -> str | None:
        """Why the native decode stack (Llama's whole layer in C++, and Qwen3.5's: (1 + w)
        norms, partial rotary, the attention's output gate, linear attention, with float32
        activations: engine/decode_stack.py) cannot run this model, or None."""
        reasons = [
            "sandwich norms" if self.sandwich_norms else "",
            f"{self.act} MLP" if self.act != "silu" else "",
            "per-layer rotary" if len(set(self.layer_rope) - {"default"}) else "",
            "attention scale" if self.attn_scale is not None else "",
            "embedding scale" if self.embed_scale is not None else "",
            "sliding window" if "sliding_attention" in self.layer_types else "",
            "attention sinks" if self.attn_sinks else "",
            "biased, clamped SwiGLU experts" if self.moe and self.moe.swiglu_limit else "",
        ]
        return ", ".join(r for r in reasons if r) or None


# A layer's norms by transformers' names: Llama's two, or Gemma's four (`sandwich_norms`).
_NORMS = ("input_layernorm", "post_attention_layernorm")
_SANDWICH_NORMS = (*_NORMS, "pre_feedforward_layernorm", "post_feedforward_layernorm")


def _tensor_kw(kw: dict[str, Any]) -> dict[str, Any]:
    return {"dtype": kw["dtype"], "device": kw["device"]}


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
                 index: int = 0, **kw: Any) -> None:  # fmt: skip
        super().__init__(tp)
        self.num_heads, self.num_kv_heads = arch.num_heads, arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.scale = self.head_dim**-0.5 if arch.attn_scale is None else arch.attn_scale
        sliding = arch.layer_types and arch.layer_types[index] == "sliding_attention"
        self.sliding_window = arch.sliding_window if sliding else None  # None: full attention
        self.backend = backend  # shared by all layers: the runner prepares it once per step
        self.output_gate = arch.attn_output_gate
        q_heads = self.num_heads * (2 if self.output_gate else 1)  # each head's gate after it
        qkv_rows = (q_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(arch.hidden_size, qkv_rows, arch.qkv_bias, **kw)
        self.o_proj = Linear(self.num_heads * self.head_dim, arch.hidden_size, arch.o_bias, **kw)
        self.eps = arch.eps
        self.q_norm = _param(arch.head_dim, **_tensor_kw(kw)) if arch.qk_norm else None
        self.k_norm = _param(arch.head_dim, **_tensor_kw(kw)) if arch.qk_norm else None
        # float32 whatever the model dtype: they enter the softmax beside the float32 scores
        self.sinks = (_param(self.num_heads, dtype=torch.float32, device=kw["device"])
                      if arch.attn_sinks else None)  # fmt: skip

    def forward(self, ops: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                ) -> torch.Tensor:  # fmt: skip
        k_cache, v_cache = kv_cache
        meta = meta.for_group(self.backend.kv_group)  # this layer's KV cache group's view
        qkv = self.qkv_proj(x)
        gate = None
        if self.output_gate:
            qkv, gate = self._split_gate(qkv)
        if self.q_norm is not None:
            qkv = self._norm_qk(ops, qkv)
        q = ops.rope_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping,
                              self.num_heads, self.num_kv_heads)  # fmt: skip
        if self.sinks is None:
            out = self.backend(q, k_cache, v_cache, meta, self.scale)
        else:
            out = self.backend(q, k_cache, v_cache, meta, self.scale, sinks=self.sinks)
        out = out.reshape(x.shape[0], self.num_heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self._reduce(self.o_proj(out))

    def _split_gate(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, (2h + 2kvh) * d]`` with each q head followed by its gate -> (the fused
        ``[T, (h + 2kvh) * d]`` row, the gate ``[T, h * d]``)."""
        t, h, d = qkv.shape[0], self.num_heads, self.head_dim
        q_gate = qkv[:, : 2 * h * d].view(t, h, 2 * d)
        q, gate = q_gate[..., :d].reshape(t, h * d), q_gate[..., d:].reshape(t, h * d)
        return torch.cat((q, qkv[:, 2 * h * d :]), dim=1), gate

    def _norm_qk(self, ops: Any, qkv: torch.Tensor) -> torch.Tensor:
        """The fused ``[T, (h + 2 kvh) * d]`` row with each head of q and k normed (v as it
        is): the norm is the model's (``ops.add_rms_norm`` with no residual)."""
        t, h, kvh, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        heads = qkv.view(t, h + 2 * kvh, d)
        q = ops.add_rms_norm(heads[:, :h].reshape(-1, d), None, self.q_norm, self.eps)[0]
        k = ops.add_rms_norm(heads[:, h : h + kvh].reshape(-1, d), None, self.k_norm, self.eps)[0]
        v = heads[:, h + kvh :]
        return torch.cat((q.view(t, h, d), k.view(t, kvh, d), v), dim=1).view(qkv.shape)


class GatedMLP(_Block):
    """``down(act(gate(x)) * up(x))``, gate and up as one projection."""

    def __init__(self, arch: Architecture, tp: TensorParallel | None, **kw: Any) -> None:
        super().__init__(tp)
        self.intermediate_size = arch.intermediate_size
        inter = arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * inter, arch.mlp_bias, **kw)
        self.down_proj = Linear(inter, arch.hidden_size, arch.mlp_bias, **kw)

    def linears(self) -> tuple[Linear, ...]:
        return (self.gate_up_proj, self.down_proj)

    def forward(self, ops: Any, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(self.down_proj(ops.silu_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    """Pre-norm attention then MLP, the residual add fused into each norm (see layer_ops)."""

    def __init__(self, arch: Architecture, backend: AttentionBackend, tp: TensorParallel | None,
                 dtype: torch.dtype, device: torch.device, quantization: str | None,
                 index: int = 0) -> None:  # fmt: skip
        super().__init__()
        self.eps = arch.eps
        kw = {"dtype": dtype, "device": device}
        self.norm_names = _SANDWICH_NORMS if arch.sandwich_norms else _NORMS
        for name in self.norm_names:
            setattr(self, name, _param(arch.hidden_size, **kw))
        # The token mixer: attention over the KV cache, or a linear-attention layer's state.
        self.self_attn: Attention | None = None
        self.linear_attn: GatedDeltaNet | None = None
        if arch.is_linear(index):
            assert arch.linear_attention is not None
            self.linear_attn = GatedDeltaNet(arch.linear_attention, arch.hidden_size, arch.eps,
                                             **kw, quantization=quantization)  # fmt: skip
        else:
            self.self_attn = Attention(arch, backend, tp, index, **kw, quantization=quantization)
        self.mlp: GatedMLP | SparseMoE
        if arch.is_sparse(index):
            assert arch.moe is not None
            self.mlp = SparseMoE(arch.moe, arch.hidden_size, **kw, quantization=quantization)
        else:
            self.mlp = GatedMLP(arch, tp, **kw, quantization=quantization)

    def linears(self) -> tuple[Linear, ...]:
        """The projections in the order the native decode stack takes them."""
        attn = self.self_attn
        mixer = (attn.qkv_proj, attn.o_proj) if attn is not None else self.linear_attn.linears()
        return (*mixer, *self.mlp.linears())

    def forward(self, ops: Any, delta: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Takes and returns (the previous block's output, the residual stream before it is
        added); ``cos``/``sin``: ``[T, head_dim]``."""
        x, residual = ops.add_rms_norm(delta, residual, self.input_layernorm, self.eps)
        if self.linear_attn is not None:  # kv_cache: this layer's state slots
            delta = self.linear_attn(x, kv_cache, meta.states)
        else:
            delta = self.self_attn(ops, x, cos, sin, kv_cache, meta)
        if self.norm_names is _SANDWICH_NORMS:  # each sub-block's output normed, then added
            norm, eps = ops.add_rms_norm, self.eps
            delta = norm(delta, None, self.post_attention_layernorm, eps)[0]
            x, residual = norm(delta, residual, self.pre_feedforward_layernorm, eps)
            return norm(self.mlp(ops, x), None, self.post_feedforward_layernorm, eps)[0], residual
        x, residual = ops.add_rms_norm(delta, residual, self.post_attention_layernorm, self.eps)
        return self.mlp(ops, x), residual
