"""The small ops around a decoder layer's matmuls, in torch: the reference set.

A layer calls ``ops.add_rms_norm``, ``ops.rope_write_kv`` and ``ops.silu_mul`` on whichever
op set the execution plan chose: `TorchOps` here, or a native build of `engine.kernels`
(bf16 on AVX512-BF16, float32 on a GGUF's blocks), which takes the same arguments and is
tested equal to these. The residual stream is carried apart from each sub-block's output,
as in vLLM, so each residual add is fused into the norm that follows it; in torch that is
the same arithmetic as ``hidden + out`` then the norm, so the float32 path stays token for
token what transformers computes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention import AttentionBackend
from engine.models.rotary import apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_plus_one(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma RMSNorm: normalise and scale by ``1 + w`` in float32, then cast."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).type_as(x)


class TorchOps:
    """The layer ops in torch, for a model whose backend writes the KV cache (``attn``),
    whose MLP activation is ``act`` and whose norms are ``norm`` (`rms_norm`, Llama's, or
    `rms_norm_plus_one`, Gemma's)."""

    def __init__(self, attn: AttentionBackend, act: Callable[[torch.Tensor], torch.Tensor],
                 norm: Callable[..., torch.Tensor] = rms_norm) -> None:  # fmt: skip
        self.attn = attn
        self.act = act
        self.norm = norm

    def add_rms_norm(
        self, delta: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + delta), residual + delta); the first layer has no residual."""
        residual = delta if residual is None else residual + delta
        return self.norm(residual, weight, eps), residual

    def rope_write_kv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
    ) -> torch.Tensor:  # fmt: skip
        """Rotate q and k of a fused ``[T, (h + 2 kvh) * d]`` row (cos, sin ``[T, d]``, or
        ``[T, r]``, r < d: partial rotary), write k and v to the cache; returns q ``[T, h, d]``."""
        h, kvh = num_heads, num_kv_heads
        qkv = qkv.view(qkv.shape[0], h + 2 * kvh, -1)
        qk = apply_rotary(qkv[:, : h + kvh], cos.unsqueeze(1), sin.unsqueeze(1))  # together
        self.attn.write_kv(k_cache, v_cache, qk[:, h:], qkv[:, h + kvh :], slot_mapping)
        return qk[:, :h]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of a fused gate/up row (silu for the Llama family)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up

    def moe_sum(self, ys: list[torch.Tensor], tokens: torch.Tensor, weights: torch.Tensor,
                num_tokens: int) -> torch.Tensor:  # fmt: skip
        """A mixture of experts' output: each token's pairs' rows (``ys``, expert by expert;
        ``tokens``: each pair's token) times their weights, added in the pairs' order, as
        transformers adds them (float32: the same bits)."""
        out = torch.zeros(num_tokens, ys[0].shape[1], dtype=ys[0].dtype, device=ys[0].device)
        return out.index_add_(0, tokens, torch.cat(ys) * weights.unsqueeze(1))


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "silu":
        return F.silu
    from transformers.activations import ACT2FN

    return ACT2FN[name]
