"""A step's decoder layers in one native call: the runner's fast path on CPU.

Where the execution plan runs the layers through a native kernels build and the cpu-paged
backend (`ExecutionPlan.decode_stack`), every layer of a step whose every token is one of
the backend's kernel rows (decodes, and queries of up to `KERNEL_MAX_QUERY` tokens over
their cache: see engine/attention/cpu_paged.py), of up to as many rows as every
projection's kernel takes, is one C++ call (`csrc/decode_stack.cpp`), through the same
kernels as the model's Python forward, which it equals bit for bit
(tests/engine/test_decode_stack.py). The model stays one forward; this is another way to
execute it, chosen per step by the runner.

Qwen3.5 (float32 activations: its GGUFs on a CPU without AVX512-BF16) runs in it too: its
Gated DeltaNet layers (`ops.LinearAttention`, on the rows' state slots) and its full
attention's output gate, (1 + w) norms and partial rotary. Its Python layers run torch's
ops there (the native layer ops compute neither): the stack makes the same ATen calls for
them from C++, and calls the same kernels for the rest, so it equals them bit for bit
(tests/engine/test_qwen35_stack.py).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from engine import kernels
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


def _rows(linear: Any) -> int:
    """The most rows the stack sends through a projection: its kernel's, or any number for
    float32 weights (a GGUF's F32 tensors), which the stack multiplies by torch's matmul as
    `project` does."""
    weight = linear.weight
    if linear.kernel_max_rows == 0 and weight is not None and weight.dtype == torch.float32:
        return sys.maxsize
    return linear.kernel_max_rows


def _linear_attention(ops: Any, attn: Any) -> Any:
    """A Gated DeltaNet layer (engine/models/linear_attention.py) as the stack takes it."""
    spec = attn.spec
    return ops.LinearAttention(
        attn.in_proj.stack_projection(ops), attn.out_proj.stack_projection(ops),
        attn.conv_weight[:, 0].contiguous(), -attn.A_log.float().exp(), attn.dt_bias.float(),
        attn.norm.float(), spec.num_k_heads, spec.num_v_heads, spec.head_v_dim, attn.eps,
    )  # fmt: skip


class DecodeStack:
    def __init__(self, model: Any, native: Any, max_rows: int) -> None:
        self.model = model
        self.native = native  # the kernels' DecodeStack
        self.max_rows = max_rows  # the most rows every projection's kernel takes

    @classmethod
    def build(cls, model: Any, plan: ExecutionPlan) -> DecodeStack | None:
        """The stack of a packed model, or None where the plan has none or a projection
        has no kernel (it would take torch's matmul)."""
        if not plan.decode_stack:
            return None
        # (Qwen3.5's layers run torch's ops in Python, the stack the native module's.)
        ops = kernels.layer_kernels(plan.dtype, plan.device, plan.quantization.layers)
        max_rows = min((_rows(linear) for linear in model.linears()), default=0)
        arch = model.arch
        qwen35 = (arch.norm_plus_one or arch.attn_output_gate or arch.linear_attention is not None
                  or arch.rotary_dim not in (None, arch.head_dim))  # fmt: skip
        # The model's Python layers on torch's ops (Qwen3.5's): the stack computes its norms
        # and activations in the same ATen ops, so the same bits (its MoE sum has no twin).
        torch_ops = plan.layer_kernels() is None
        moe = any(isinstance(layer.mlp, SparseMoE) for layer in model.layers)
        if ops is None or max_rows == 0 or (torch_ops and moe):
            return None
        if qwen35 and (model.dtype != torch.float32 or not torch_ops):
            return None
        # (1 + w) norms as the float32 weight 1 + w: exactly what torch's norm multiplies by
        norm = (lambda w: 1.0 + w.float()) if arch.norm_plus_one else (lambda w: w)  # noqa: E731
        layers = []
        for layer in model.layers:
            norms = (norm(layer.input_layernorm), norm(layer.post_attention_layernorm))
            attn = layer.self_attn
            if attn is None:
                layers.append(
                    ops.DecoderLayer(
                        *norms,
                        None,
                        None,
                        *_mlp(ops, layer.mlp),
                        linear=_linear_attention(ops, layer.linear_attn),
                    )
                )
                continue
            q_norm, k_norm = (
                (None, None) if attn.q_norm is None else (norm(attn.q_norm), norm(attn.k_norm))
            )
            layers.append(ops.DecoderLayer(*norms, attn.qkv_proj.stack_projection(ops),
                                           attn.o_proj.stack_projection(ops),
                                           *_mlp(ops, layer.mlp), q_norm, k_norm))  # fmt: skip
        native = ops.DecodeStack(
            layers, norm(model.norm), arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.eps,
            arch.head_dim**-0.5,  # as each layer's attention scale
            output_gate=arch.attn_output_gate, torch_ops=torch_ops,
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
        states, slots = meta.states, None
        if states is not None:  # linear-attention layers: every row a request's one token
            if states.prefills or states.decode_rows.numel() != input_ids.shape[0]:
                return None
            slots = states.decode_slots
        cos, sin = self.model.rotary.lookup(positions)
        hidden = self.model.embed(input_ids)
        out = self.native.forward(hidden, cos, sin, kv_caches, meta.slot_mapping, *tables, slots)
        if states is not None:
            self._save_after_decode(kv_caches, states)
        return out

    def _save_after_decode(self, kv_caches: list[Any], states: Any) -> None:
        """The snapshots a decode writes (each one-token request's state after that token),
        as each linear-attention layer's own forward copies them."""
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            if layer.linear_attn is not None:
                layer.linear_attn._save_after_decode(kv_cache, states)
