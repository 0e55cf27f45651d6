"""The numerical core of a Gated DeltaNet layer (Qwen3.5's linear attention), in torch.

A linear layer keeps two states per request, in slots of pools its caller owns: the
causal conv's last ``K - 1`` inputs (``conv_states [S, C, K-1]``, the model's dtype) and
the delta rule's recurrent state (``states [S, Hv, Dk, Dv]``, float32). The ops here take
what the layer's projections computed (``mixed_qkv`` before the conv, the log-decay ``g``
and ``beta`` after its sigmoid), run the conv, silu, l2norm and the gated delta rule, and
return the core output before the gated RMSNorm, exactly as transformers'
``Qwen3_5GatedDeltaNet`` computes them (``causal_conv1d_fn``/``causal_conv1d_update`` and
``torch_chunk_gated_delta_rule``/``torch_recurrent_gated_delta_rule``):

* `gdn_prefill`: one request's tokens, the chunk-parallel form, continuing from its slot's
  states and writing them back; ``saves`` also snapshots the states after given prefixes.
* `gdn_decode`: one token for each of B requests, one recurrent step each, in their slots:
  the native kernel (`engine.kernels`, csrc/gated_delta_net.cpp, one call for the whole
  step) where `decode_kernels` finds one, else the same step in torch's ops (`decode_torch`).

The recurrence, per value head (its key head serving ``Hv // Hk`` consecutive value heads),
with q and k l2-normalised, q scaled by ``Dk ** -0.5``::

    S = exp(g_t) S;  S += k_t (beta_t (v_t - k_t^T S));  o_t = q_t^T S     (S: [Dk, Dv])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.kernels import layer_kernels

CHUNK = 64  # the chunked form's longest chunk, as transformers' torch_chunk_gated_delta_rule
L2NORM_EPS = 1e-6


@dataclass(frozen=True)
class GDNDims:
    """A Gated DeltaNet layer's shape: key/value heads (``num_v_heads`` a multiple of
    ``num_k_heads``), their head dims, and the causal conv's kernel size."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"{self.num_v_heads} value heads for {self.num_k_heads} key heads")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """C: the conv's channels, q, k then v."""
        return 2 * self.key_dim + self.value_dim


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """transformers' (and FLA's) l2norm over the last dim: ``x / sqrt(sum(x^2) + eps)``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _qkv(mixed: torch.Tensor, dims: GDNDims) -> tuple[torch.Tensor, ...]:
    """The conv's output ``[N, C]`` as float32 q, k ``[N, Hv, Dk]`` (normalised, q scaled,
    each key head repeated for its value heads) and v ``[N, Hv, Dv]``."""
    n, rep = mixed.shape[0], dims.num_v_heads // dims.num_k_heads
    q, k, v = mixed.float().split([dims.key_dim, dims.key_dim, dims.value_dim], dim=-1)
    q = l2norm(q.reshape(n, dims.num_k_heads, dims.head_k_dim)) * dims.head_k_dim**-0.5
    k = l2norm(k.reshape(n, dims.num_k_heads, dims.head_k_dim))
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    return q, k, v.reshape(n, dims.num_v_heads, dims.head_v_dim)


def _conv_silu(window: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The depthwise causal conv over ``window [C, K-1+T]`` (the conv state then the new
    inputs), then silu: ``[T, C]`` in ``dtype``. In float32, rounded to ``dtype`` once
    (transformers' causal_conv1d_fn rounds the conv, then silu, in a bf16 model's dtype)."""
    out = F.conv1d(window.float().unsqueeze(0), weight.float().unsqueeze(1), groups=weight.shape[0])
    return F.silu(out[0]).to(dtype).t()


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T tokens in the chunk-parallel form (float32 throughout):
    q, k ``[H, T, Dk]`` (normalised, q scaled), v ``[H, T, Dv]``, g, beta ``[H, T]``, the
    initial state ``[H, Dk, Dv]``; returns (the output ``[H, T, Dv]``, the final state).

    transformers' torch_chunk_gated_delta_rule, with T cut into ``ceil(T / 64)`` chunks of
    equal length (not 64 and padding: the same sums, less padding for a short T)."""
    h, t, dk = k.shape
    num_chunks = -(-t // CHUNK)
    size = -(-t // num_chunks)
    pad = num_chunks * size - t  # zero k, v, beta and g: no change to the state
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    q, k, v = (x.reshape(h, num_chunks, size, x.shape[-1]) for x in (q, k, v))
    beta = beta.reshape(h, num_chunks, size, 1)
    cum = g.reshape(h, num_chunks, size).cumsum(dim=-1)  # log decay since the chunk's start
    k_beta, v_beta = k * beta, v * beta

    # decay[i, j] = exp(cum_i - cum_j) for j <= i, 0 above the diagonal (-inf before exp)
    upper = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    # The UT transform: (I + tril(K_beta K^T * decay, -1))^-1 applied to v_beta and to the
    # keys reading the chunk's incoming state
    system = (k_beta @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([v_beta, k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    new_values, k_cumdecay = solved.split([v.shape[-1], dk], dim=-1)
    intra = (q @ k.transpose(-1, -2)) * decay

    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_values)
    for i in range(num_chunks):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(h, num_chunks * size, -1)[:, :t], state


def gdn_prefill(
    mixed_qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    dims: GDNDims,
    saves: Sequence[tuple[int, torch.Tensor, torch.Tensor]] = (),
) -> torch.Tensor:
    """One request's T tokens: ``mixed_qkv [T, C]``, ``g`` (float32), ``beta [T, Hv]``,
    ``conv_weight [C, K]``. ``conv_state [C, K-1]`` and ``state [Hv, Dk, Dv]`` (float32) are
    read as the states before the first token and written, in place, with those after the
    last. Each ``(t, conv_dst, state_dst)`` of ``saves`` (0 < t <= T) receives the states
    after the first t tokens. Returns the core output ``[T, Hv, Dv]`` in mixed_qkv's dtype."""
    t_len = mixed_qkv.shape[0]
    keep = dims.conv_kernel - 1
    window = torch.cat([conv_state.to(conv_weight.dtype), mixed_qkv.t().to(conv_weight.dtype)], 1)
    q, k, v = (
        x.transpose(0, 1) for x in _qkv(_conv_silu(window, conv_weight, mixed_qkv.dtype), dims)
    )
    g, beta = g.float().t(), beta.float().t()

    bounds = sorted({t for t, _, _ in saves} | {t_len})
    if bounds[0] <= 0 or bounds[-1] > t_len:
        raise ValueError(f"save points {bounds[:-1]} outside 1..{t_len}")
    outs, running, start = [], state.float(), 0
    for end in bounds:
        out, running = chunk_gated_delta_rule(
            q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end],
            beta[:, start:end], running,
        )  # fmt: skip
        outs.append(out)
        for t, conv_dst, state_dst in saves:
            if t == end:
                conv_dst.copy_(window[:, t : t + keep])
                state_dst.copy_(running)
        start = end
    conv_state.copy_(window[:, t_len:])
    state.copy_(running)
    return torch.cat(outs, dim=1).transpose(0, 1).to(mixed_qkv.dtype)


def gdn_decode(
    mixed_qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    dims: GDNDims,
    quantization: str | None = None,
) -> torch.Tensor:
    """One token for each of B requests: ``mixed_qkv [B, C]``, ``g``, ``beta [B, Hv]``; one
    recurrent step each on the pools ``conv_states [S, C, K-1]`` and ``states [S, Hv, Dk,
    Dv]`` at ``slots [B]`` (distinct), in place. Returns ``[B, Hv, Dv]`` in mixed_qkv's dtype.
    ``quantization``: the layer's projections' (`decode_kernels` reads it)."""
    kernels = decode_kernels(mixed_qkv, conv_weight, conv_states, states, dims, quantization)
    if kernels is not None:
        return kernels.gated_delta_decode(
            mixed_qkv.contiguous(), g.float().contiguous(), beta.float().contiguous(),
            conv_weight.contiguous(), conv_states, states, slots.long().contiguous(),
            dims.num_k_heads,
        )  # fmt: skip
    return decode_torch(mixed_qkv, g, beta, conv_weight, conv_states, states, slots, dims)


def decode_kernels(
    mixed_qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    states: torch.Tensor,
    dims: GDNDims,
    quantization: str | None = None,
) -> ModuleType | None:
    """The native module whose ``gated_delta_decode`` serves this step, or None (torch's
    ops). The rule of the layer ops (`engine.kernels.layer_kernels`): bf16 on a CPU with the
    AVX512-BF16 build; float32 where a GGUF's blocks serve the projections (any build: the
    GGUF path on an AVX2 or a VNNI CPU, where torch's ~20 ops took a third of a Qwen3.5
    stand-in's decode step, bench/README.md); other float32 models stay on torch's ops, the
    token-exact reference (the kernel equals them up to the order of float32 sums)."""
    fits = (
        conv_weight.dtype == conv_states.dtype == mixed_qkv.dtype
        and states.dtype == torch.float32
        and dims.head_k_dim % 8 == 0
        and dims.head_v_dim % 8 == 0
        and conv_states.is_contiguous()  # the pools are written in place
        and states.is_contiguous()
    )
    return layer_kernels(mixed_qkv.dtype, mixed_qkv.device, quantization) if fits else None


def decode_torch(
    mixed_qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    dims: GDNDims,
) -> torch.Tensor:
    """`gdn_decode` in torch's ops."""
    window = torch.cat([conv_states[slots].to(conv_weight.dtype),
                        mixed_qkv.unsqueeze(-1).to(conv_weight.dtype)], dim=-1)  # fmt: skip
    conv_states.index_copy_(0, slots, window[..., 1:].to(conv_states.dtype))
    conv = (window.float() * conv_weight.float()).sum(dim=-1)  # a window of exactly K
    q, k, v = _qkv(F.silu(conv).to(mixed_qkv.dtype), dims)

    s = states[slots]  # [B, Hv, Dk, Dv], a copy
    s.mul_(g.float().exp()[..., None, None])
    delta = (v - (k.unsqueeze(-2) @ s).squeeze(-2)) * beta.float().unsqueeze(-1)
    flat = s.view(-1, dims.head_k_dim, dims.head_v_dim)
    flat.baddbmm_(k.reshape(-1, dims.head_k_dim, 1), delta.reshape(-1, 1, dims.head_v_dim))
    states.index_copy_(0, slots, s)
    return (q.unsqueeze(-2) @ s).squeeze(-2).to(mixed_qkv.dtype)
