"""A mixture-of-experts MLP (Qwen3-MoE): a router scores every expert for each token, the
token goes through its top-k experts (each a SwiGLU MLP of its own), and their outputs are
added up weighted by the router's probabilities.

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

    @classmethod
    def of(cls, hf_config: Any) -> MoESpec:
        """Qwen3-MoE's config: every `decoder_sparse_step`-th layer sparse but those in
        `mlp_only_layers` (transformers' Qwen3MoeDecoderLayer)."""
        experts, step = hf_config.num_experts, getattr(hf_config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        layers = frozenset(i for i in range(hf_config.num_hidden_layers)
                           if experts > 0 and (i + 1) % step == 0 and i not in dense)  # fmt: skip
        return cls(experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
                   bool(getattr(hf_config, "norm_topk_prob", False)), layers)  # fmt: skip


class ExpertMLP(nn.Module):
    """One expert: ``down(silu(gate(x)) * up(x))``, gate and up as one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, **kw: Any) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, False, **kw)
        self.down_proj = Linear(intermediate_size, hidden_size, False, **kw)

    def forward(self, ops: Any, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


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
        kw = {"dtype": dtype, "device": device, "quantization": quantization}
        self.experts = nn.ModuleList(
            ExpertMLP(hidden_size, spec.intermediate_size, **kw) for _ in range(spec.num_experts)
        )

    def linears(self) -> tuple[Linear, ...]:
        return tuple(p for e in self.experts for p in (e.gate_up_proj, e.down_proj))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k (weights ``[T, k]`` in x's dtype, experts ``[T, k]``)."""
        probs = torch.softmax(F.linear(x.float(), self.gate), dim=-1)
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
