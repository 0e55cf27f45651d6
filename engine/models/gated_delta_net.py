"""TEMPORARY: the gated_delta_net API over transformers' own functions (until the real module lands)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)


@dataclass(frozen=True)
class GDNDims:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int


def _conv(x, conv_state, weight):
    full = torch.cat([conv_state.to(x.dtype), x.t()], dim=-1)  # [C, K-1+T]
    out = F.conv1d(full.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])[
        0
    ]
    return F.silu(out).t().to(x.dtype), full


def _split(mixed, dims, T):
    kd, vd = dims.num_k_heads * dims.head_k_dim, dims.num_v_heads * dims.head_v_dim
    q, k, v = torch.split(mixed, [kd, kd, vd], dim=-1)
    return (
        q.reshape(1, T, -1, dims.head_k_dim),
        k.reshape(1, T, -1, dims.head_k_dim),
        v.reshape(1, T, -1, dims.head_v_dim),
    )


def _segment(mixed, g, beta, w, conv_state, state, dims):
    T = mixed.shape[0]
    out, full = _conv(mixed, conv_state, w)
    q, k, v = _split(out, dims, T)
    core, new = torch_chunk_gated_delta_rule(
        q,
        k,
        v,
        g=g[None],
        beta=beta[None],
        initial_state=state[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    conv_state.copy_(full[:, -(dims.conv_kernel - 1) :])
    state.copy_(new[0])
    return core[0]


def gdn_prefill(mixed_qkv, g, beta, conv_weight, conv_state, state, dims, saves=()):
    outs, start = [], 0
    for t, conv_dst, state_dst in list(saves) + [(mixed_qkv.shape[0], None, None)]:
        if t > start:
            outs.append(
                _segment(
                    mixed_qkv[start:t],
                    g[start:t],
                    beta[start:t],
                    conv_weight,
                    conv_state,
                    state,
                    dims,
                )
            )
            start = t
        if conv_dst is not None:
            conv_dst.copy_(conv_state)
            state_dst.copy_(state)
    return torch.cat(outs)


def gdn_decode(mixed_qkv, g, beta, conv_weight, conv_states, states, slots, dims):
    outs = []
    for i in range(mixed_qkv.shape[0]):
        s = int(slots[i])
        cs, st = conv_states[s], states[s]
        out, full = _conv(mixed_qkv[i : i + 1], cs, conv_weight)
        q, k, v = _split(out, dims, 1)
        core, new = torch_recurrent_gated_delta_rule(
            q,
            k,
            v,
            g=g[i : i + 1][None],
            beta=beta[i : i + 1][None],
            initial_state=st[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        cs.copy_(full[:, 1:])
        st.copy_(new[0])
        outs.append(core[0])
    return torch.cat(outs)
