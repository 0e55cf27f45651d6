"""A mixture-of-experts MLP (Qwen3-MoE, gpt-oss): a router scores every expert for each
token, the token goes through its top-k experts (each a SwiGLU MLP of its own), and their
outputs are added up weighted by the router's probabilities.

gpt-oss' variant (`MoESpec.of` reads it from the config): biases on the router and on every
expert projection, the weights a softmax over the k largest logits (Qwen3-MoE takes the k
largest of a softmax over all), and a clamped SwiGLU: the gate clamped from above and the up
projection on both sides at `swiglu_limit`, then ``(up + 1) * gate * sigmoid(alpha * gate)``.

A step's tokens are grouped by expert, so each chosen expert's weights are read once per
step whatever the batch holds (what llama.cpp's `mul_mat_id` and vLLM's fused MoE do): at
batch 1 a token reads its k experts, at 32 streams the step reads each expert its tokens
chose once. Each expert is a pair of `Linear` projections, so a GGUF's expert blocks go
through the same kernels as any projection of their format.

The router runs in float32 whatever the model dtype, as llama.cpp computes it (its
`ffn_gate_inp` is float32 in every GGUF): which experts a token takes is a discontinuous
choice that a bf16 rounding of a near-tie would flip. For float32 weights that is
transformers' own computation, in its order (experts added in ascending order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.linear import Linear


@dataclass(frozen=True)
class MoESpec:
    """The mixture's sizes, and which layers have it (the others keep a dense MLP)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's
    norm_topk_prob: bool  # the k chosen probabilities rescaled to sum to 1
    layers: frozenset[int]
    # -- gpt-oss' variant (see the module's docstring); the defaults are Qwen3-MoE's -------
    bias: bool = False  # the router and every expert projection have a bias
    softmax_of_top_k: bool = False  # the weights: a softmax over the k largest logits
    swiglu_limit: float | None = None  # the clamped SwiGLU's limit; None: silu(gate) * up
    swiglu_alpha: float = 1.702

    @classmethod
    def of(cls, hf_config: Any) -> MoESpec:
        """Qwen3-MoE's config: every `decoder_sparse_step`-th layer sparse but those in
        `mlp_only_layers` (transformers' Qwen3MoeDecoderLayer); gpt-oss': every layer, its
        experts `intermediate_size` wide."""
        if getattr(hf_config, "model_type", None) == "gpt_oss":
            return cls(hf_config.num_experts, hf_config.num_experts_per_tok,
                       hf_config.intermediate_size, True,
                       frozenset(range(hf_config.num_hidden_layers)), bias=True,
                       softmax_of_top_k=True, swiglu_limit=float(hf_config.swiglu_limit),
                       swiglu_alpha=float(hf_config.swiglu_alpha))  # fmt: skip
        experts, step = hf_config.num_experts, getattr(hf_config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        layers = frozenset(i for i in range(hf_config.num_hidden_layers)
                           if experts > 0 and (i + 1) % step == 0 and i not in dense)  # fmt: skip
        return cls(experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
                   bool(getattr(hf_config, "norm_topk_prob", False)), layers)  # fmt: skip


class ExpertMLP(nn.Module):
    """One expert: ``down(silu(gate(x)) * up(x))`` (or gpt-oss' clamped SwiGLU), gate and
    up as one projection."""

    def __init__(self, spec: MoESpec, hidden_size: int, **kw: Any) -> None:
        super().__init__()
        self.spec = spec
        self.gate_up_proj = Linear(hidden_size, 2 * spec.intermediate_size, spec.bias, **kw)
        self.down_proj = Linear(spec.intermediate_size, hidden_size, spec.bias, **kw)

    def forward(self, ops: Any, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.spec.swiglu_limit is None:
            return self.down_proj(ops.silu_mul(gate_up))
        return self.down_proj(clamped_swiglu(gate_up, self.spec.swiglu_limit,
                                             self.spec.swiglu_alpha))  # fmt: skip


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss' activation of ``[T, 2I]`` (gate columns, then up), in transformers' order of
    operations (GptOssExperts._apply_gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class SparseMoE(nn.Module):
    """The router (``gate``, float32 ``[experts, hidden]``) and the experts."""

    def __init__(self, spec: MoESpec, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, quantization: str | None) -> None:  # fmt: skip
        super().__init__()
        self.spec = spec
        self.gate = nn.Parameter(
            torch.empty(spec.num_experts, hidden_size, dtype=torch.float32, device=device),
            requires_grad=False,
        )
        self.gate_bias = (
            nn.Parameter(torch.empty(spec.num_experts, dtype=torch.float32, device=device),
                         requires_grad=False) if spec.bias else None
        )  # fmt: skip
        kw = {"dtype": dtype, "device": device, "quantization": quantization}
        self.experts = nn.ModuleList(
            ExpertMLP(spec, hidden_size, **kw) for _ in range(spec.num_experts)
        )

    def linears(self) -> tuple[Linear, ...]:
        return tuple(p for e in self.experts for p in (e.gate_up_proj, e.down_proj))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k (weights ``[T, k]`` in x's dtype, experts ``[T, k]``)."""
        logits = F.linear(x.float(), self.gate, self.gate_bias)
        if self.spec.softmax_of_top_k:
            top, experts = torch.topk(logits, self.spec.top_k, dim=-1)
            return torch.softmax(top, dim=-1).to(x.dtype), experts
        probs = torch.softmax(logits, dim=-1)
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, ops: Any, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        # The (token, choice) pairs sorted by expert: each expert's tokens in one call.
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        tokens = order // self.spec.top_k
        pair_weights = weights.flatten().index_select(0, order)
        counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()
        # Each chosen expert on its contiguous run of the sorted rows, once.
        sorted_x = x.index_select(0, tokens)
        ys, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                ys.append(self.experts[expert](ops, sorted_x[start : start + count]))
            start += count
        return ops.moe_sum(ys, tokens, pair_weights, x.shape[0])
