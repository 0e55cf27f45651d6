"""A step's decoder layers in one native call: the runner's fast path on CPU.

Where the execution plan runs the layers through a native kernels build and the cpu-paged
backend (`ExecutionPlan.decode_stack`), every layer of a step whose every token is one of
the backend's kernel rows (decodes, and queries of up to `KERNEL_MAX_QUERY` tokens over
their cache: see engine/attention/cpu_paged.py), of up to as many rows as every
projection's kernel takes, is one C++ call (`csrc/decode_stack.cpp`), through the same
kernels as the model's Python forward, which it equals bit for bit
(tests/engine/test_decode_stack.py). The model stays one forward; this is another way to
execute it, chosen per step by the runner.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention import AttentionMetadata
from engine.execution_plan import ExecutionPlan
from engine.models.moe import SparseMoE


def _mlp(ops: Any, mlp: Any) -> tuple[Any, Any, Any]:
    """A layer's MLP as the stack's layer takes it: (gate_up, down, None) where dense,
    (None, None, its experts) for a mixture of experts (engine/models/moe.py)."""
    if not isinstance(mlp, SparseMoE):
        return mlp.gate_up_proj.stack_projection(ops), mlp.down_proj.stack_projection(ops), None
    experts = ops.Experts(mlp.gate, [e.gate_up_proj.stack_projection(ops) for e in mlp.experts],
                          [e.down_proj.stack_projection(ops) for e in mlp.experts],
                          mlp.spec.top_k, mlp.spec.norm_topk_prob)  # fmt: skip
    return None, None, experts


class DecodeStack:
    def __init__(self, model: Any, native: Any, max_rows: int) -> None:
        self.model = model
        self.native = native  # the kernels' DecodeStack
        self.max_rows = max_rows  # the most rows every projection's kernel takes

    @classmethod
    def build(cls, model: Any, plan: ExecutionPlan) -> DecodeStack | None:
        """The stack of a packed model, or None where the plan has none or a projection
        has no kernel (it would take torch's matmul)."""
        ops = plan.layer_kernels()
        linears = model.linears()
        max_rows = min((linear.kernel_max_rows for linear in linears), default=0)
        if not plan.decode_stack or ops is None or max_rows == 0:
            return None
        layers = [
            ops.DecoderLayer(layer.input_layernorm, layer.post_attention_layernorm,
                             layer.self_attn.qkv_proj.stack_projection(ops),
                             layer.self_attn.o_proj.stack_projection(ops), *_mlp(ops, layer.mlp),
                             layer.self_attn.q_norm, layer.self_attn.k_norm)
            for layer in model.layers
        ]  # fmt: skip
        arch = model.arch
        native = ops.DecodeStack(
            layers, model.norm, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.eps,
            arch.head_dim**-0.5,  # as each layer's attention scale
        )  # fmt: skip
        return cls(model, native, max_rows)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """The step's final hidden states, or None where it is not a step of kernel rows the
        stack takes (the model's forward then runs it). The backend must be prepared."""
        if input_ids.shape[0] > self.max_rows:
            return None
        tables = self.model.attn_backend.kernel_only_tables()
        if tables is None:
            return None
        cos, sin = self.model.rotary.lookup(positions)
        hidden = self.model.embed(input_ids)
        return self.native.forward(hidden, cos, sin, kv_caches, meta.slot_mapping, *tables)
