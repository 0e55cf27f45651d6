"""Gated DeltaNet: the linear-attention layer of Qwen3.5 and Qwen3-Next.

Per token: one fused input projection (transformers' in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a as row ranges of one `Linear`), a short causal depthwise convolution over q, k
and v, the gated delta rule over a recurrent state (engine/models/gated_delta_net.py), an
RMSNorm of each value head gated by silu(z), and the output projection. The state lives
in the request's slot (engine/state_cache.py): a prefill continues it from where the slot
left off (zeros, a snapshot, or its own previous chunk), a decode step advances it by one
token; the snapshots prefix caching asks for are written at their tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.gated_delta_net import GDNDims, gdn_decode, gdn_prefill
from engine.models.linear import Linear
from engine.state_cache import StateMetadata, StateShape, StateTensors


@dataclass(frozen=True)
class LinearAttentionSpec(GDNDims):
    """A Gated DeltaNet layer's sizes (transformers' ``linear_*`` config fields): the ops'
    shape, with the fused projection's rows and the state's shape per slot."""

    def rows(self) -> dict[str, tuple[int, int]]:
        """Each of transformers' input projections as rows of the fused one."""
        c, v, h = self.conv_dim, self.value_dim, self.num_v_heads
        return {"in_proj_qkv": (0, c), "in_proj_z": (c, v), "in_proj_b": (c + v, h),
                "in_proj_a": (c + v + h, h)}  # fmt: skip

    def state_shape(self) -> StateShape:
        return StateShape(self.conv_dim, self.conv_kernel, self.num_v_heads, self.head_k_dim,
                          self.head_v_dim)  # fmt: skip


class GatedDeltaNet(nn.Module):
    """The token mixer of a linear-attention layer (in place of `Attention`)."""

    def __init__(self, spec: LinearAttentionSpec, hidden_size: int, eps: float, **kw: Any) -> None:
        super().__init__()
        self.spec, self.eps = spec, eps
        self.dims = spec  # (a GDNDims: the ops' shape)
        in_rows = spec.conv_dim + spec.value_dim + 2 * spec.num_v_heads
        self.in_proj = Linear(hidden_size, in_rows, False, **kw)
        self.out_proj = Linear(spec.value_dim, hidden_size, False, **kw)
        dtype, device = kw["dtype"], kw["device"]
        empty = lambda *shape: nn.Parameter(  # noqa: E731
            torch.empty(shape, dtype=dtype, device=device), requires_grad=False
        )
        self.conv_weight = empty(spec.conv_dim, 1, spec.conv_kernel)  # transformers' conv1d's
        self.dt_bias = empty(spec.num_v_heads)
        self.A_log = empty(spec.num_v_heads)
        self.norm = empty(spec.head_v_dim)

    def linears(self) -> tuple[Linear, ...]:
        return (self.in_proj, self.out_proj)

    def forward(self, x: torch.Tensor, states: StateTensors, meta: StateMetadata) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``."""
        spec = self.spec
        proj = self.in_proj(x)
        c, v, h = spec.conv_dim, spec.value_dim, spec.num_v_heads
        mixed, z, b, a = proj.split((c, v, h, h), dim=-1)
        beta = b.sigmoid()
        # In float32, as transformers computes it (in a 16-bit dtype A could reach -inf).
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        conv, rec = states
        weight = self.conv_weight[:, 0]
        rows = meta.decode_rows
        if not meta.prefills and rows.numel() == x.shape[0]:  # every row a request's token
            core = gdn_decode(mixed, g, beta, weight, conv, rec, meta.decode_slots, self.dims,
                              self.in_proj.quantization)  # fmt: skip
            self._save_after_decode(states, meta)
            return self._out(core, z, x.shape[0])
        core = x.new_empty(x.shape[0], h, spec.head_v_dim)
        for r in meta.prefills:
            s, e = meta.query_start[r], meta.query_start[r + 1]
            slot = meta.slots[r]
            saves = [(t, conv[d], rec[d]) for t, d in meta.saves[r]]
            core[s:e] = gdn_prefill(mixed[s:e], g[s:e], beta[s:e], weight, conv[slot],
                                    rec[slot], self.dims, saves)  # fmt: skip
        if rows.numel():
            core[rows] = gdn_decode(mixed[rows], g[rows], beta[rows], weight, conv, rec,
                                    meta.decode_slots, self.dims,
                                    self.in_proj.quantization)  # fmt: skip
            self._save_after_decode(states, meta)
        return self._out(core, z, x.shape[0])

    def _out(self, core: torch.Tensor, z: torch.Tensor, tokens: int) -> torch.Tensor:
        """The core output ``[T, Hv, Dv]`` through the gated norm and the out projection."""
        spec = self.spec
        out = self._gated_norm(core, z.reshape(-1, spec.num_v_heads, spec.head_v_dim))
        return self.out_proj(out.reshape(tokens, spec.value_dim))

    @staticmethod
    def _save_after_decode(states: StateTensors, meta: StateMetadata) -> None:
        """A one-token request's snapshot is its state after that token: its slot, copied."""
        for r, saves in enumerate(meta.saves):
            if saves and r not in meta.prefills:
                ((_, dst),) = saves
                for t in states:
                    t[dst].copy_(t[meta.slots[r]])

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """transformers' Qwen3_5RMSNormGated: each value head normed in float32, scaled by
        the weight in the model dtype, times silu(z) in float32."""
        dtype = core.dtype
        xf = core.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.norm * xf.to(dtype)
        return (out * F.silu(z.float())).to(dtype)
