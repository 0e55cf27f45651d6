"""The alternatives bench/attention_bench.py compares with the default backend: SDPA per
request, other decode group sizes, the cascade with an explicit merge, decode kernels by
SDPA's GQA or explicit matmuls, and compiled flex_attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

import engine.attention.sdpa as sdpa
from bench.attention_steps import BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS
from engine.attention import SdpaBackend

# --------------------------------------------------------------------------- alternative backends


def sdpa_per_request(q, k_cache, v_cache, meta, scale):
    """The obvious loop: one SDPA call per request, enable_gqa, fresh gathers."""
    out = torch.empty(q.shape, dtype=q.dtype)
    starts = meta.query_start_loc_list
    for r, q_len in enumerate(meta.query_lens):
        seq_len = meta.seq_lens_list[r]
        n = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
        table = meta.block_tables[r, :n]
        keys = k_cache.index_select(0, table).flatten(0, 1)[:seq_len].transpose(0, 1)[None]
        values = v_cache.index_select(0, table).flatten(0, 1)[:seq_len].transpose(0, 1)[None]
        qh = q[starts[r] : starts[r + 1]].transpose(0, 1)[None]
        mask = None
        if q_len > 1:
            mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
        o = F.scaled_dot_product_attention(
            qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[starts[r] : starts[r + 1]] = o[0].transpose(0, 1)
    return out


def sdpa_backend(decode_group: int | None = None, cascade: bool = True) -> SdpaBackend:
    return SdpaBackend(NUM_HEADS, NUM_KV_HEADS, decode_group, cascade)


class SdpaWithKernel(SdpaBackend):
    """The SDPA backend with one of its kernels (a function of engine.attention.sdpa) swapped."""

    def __init__(self, kernel: str, fn: Callable, **options) -> None:
        super().__init__(NUM_HEADS, NUM_KV_HEADS, **options)
        self.kernel, self.fn = kernel, fn

    def __call__(self, q, k_cache, v_cache, meta, scale):
        original = getattr(sdpa, self.kernel)
        setattr(sdpa, self.kernel, self.fn)
        try:
            return super().__call__(q, k_cache, v_cache, meta, scale)
        finally:
            setattr(sdpa, self.kernel, original)


def _with_decode_kernel(decode_fn, group_size: int = 1 << 30) -> SdpaWithKernel:
    """The default backend with its per-group decode kernel swapped for ``decode_fn``."""
    return SdpaWithKernel("_sdpa_decode_group", decode_fn, decode_group=group_size, cascade=False)


def cascade_explicit_merge():
    """The default backend with the cascade's suffix pass done by explicit matmuls.

    Each member's own blocks are attended with matmul + float32 softmax, keeping the
    log-sum-exp, and merged with the prefix result by the formula, instead of the
    default's single SDPA call that merges through pseudo keys.
    """

    def suffix(q, k_cache, v_cache, group, scale, prefix_out, prefix_lse):
        size, num_heads, head_dim = q.shape
        per_kv = num_heads // NUM_KV_HEADS
        keys, values = sdpa._gather_blocks(k_cache, v_cache, group.flat_block_table, size,
                                           q.dtype)  # fmt: skip
        keys, values = sdpa._as_float32(keys, values)
        own = slice(0, group.padded_len)
        qg = q.reshape(size, NUM_KV_HEADS, per_kv, head_dim).float() * scale
        scores = torch.empty(NUM_KV_HEADS, size, per_kv, group.padded_len)
        for j in range(NUM_KV_HEADS):
            torch.bmm(qg[:, j], keys[:, own, j].transpose(1, 2), out=scores[j])
        scores += group.mask[:, 0, :, own].unsqueeze(0)  # 0 / -inf for padding
        row_max = scores.amax(-1, keepdim=True)
        weights = scores.sub_(row_max).exp_()
        row_sum = weights.sum(-1, keepdim=True)
        out = torch.empty(NUM_KV_HEADS, size, per_kv, head_dim)
        for j in range(NUM_KV_HEADS):
            torch.bmm(weights[j], values[:, own, j], out=out[j])
        lse = (row_max + row_sum.log()).squeeze(-1).permute(1, 0, 2).reshape(size, num_heads)
        out = (out / row_sum).permute(1, 0, 2, 3).reshape(size, num_heads, head_dim)
        top = torch.maximum(lse, prefix_lse)
        w_own, w_prefix = (lse - top).exp()[..., None], (prefix_lse - top).exp()[..., None]
        merged = (out * w_own + prefix_out * w_prefix) / (w_own + w_prefix)
        return merged.to(q.dtype)

    return SdpaWithKernel("_sdpa_cascade_suffix", suffix)


def _gather_padded(cache, group, size):
    blocks = cache.index_select(0, group.flat_block_table)  # a fresh tensor per call
    return blocks.view(size, group.padded_len, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)


def decode_sdpa_enable_gqa(q, k_cache, v_cache, group, scale):
    """Decodes as [G, h, 1, d] queries with SDPA's own GQA broadcasting (fresh gathers)."""
    n = q.shape[0]
    out = F.scaled_dot_product_attention(
        q[:, :, None], _gather_padded(k_cache, group, n), _gather_padded(v_cache, group, n),
        attn_mask=group.mask, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out[:, :, 0]


def decode_matmul(q, k_cache, v_cache, group, scale):
    """Decodes with explicit matmul / float32 softmax (fresh gathers)."""
    n = q.shape[0]
    keys, values = _gather_padded(k_cache, group, n), _gather_padded(v_cache, group, n)
    return _matmul_attention(q, keys, values, group, scale)


def decode_matmul_reused(q, k_cache, v_cache, group, scale):
    """Explicit matmul / float32 softmax over K/V gathered into the reused workspace."""
    n = q.shape[0]
    keys, values = sdpa._gather_blocks(k_cache, v_cache, group.flat_block_table, n, q.dtype)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [G, kvh, S, d], strided
    return _matmul_attention(q, keys, values, group, scale)


def _matmul_attention(q, keys, values, group, scale):
    """softmax(q K^T * scale, float32, masked) V over gathered ``[G, kvh, S, d]`` K/V."""
    n = q.shape[0]
    qg = q.reshape(n, NUM_KV_HEADS, -1, HEAD_DIM)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale
    if group.mask is not None:
        scores = scores.masked_fill(~group.mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values).reshape(n, NUM_HEADS, HEAD_DIM)


def make_flex_backend():
    """flex_attention compiled by inductor: padded batched decode + per-request prefill."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)

    def decode(q, k_cache, v_cache, group, scale):
        d = q.shape[0]
        seq_lens = (
            group.mask.view(d, -1).sum(-1)
            if group.mask is not None
            else torch.full((d,), group.padded_len)
        )

        def key_valid(b, h, q_idx, kv_idx):
            return kv_idx < seq_lens[b]

        block_mask = create_block_mask(key_valid, d, None, 1, group.padded_len, device="cpu")
        out = flex(
            q[:, :, None], _gather_padded(k_cache, group, d), _gather_padded(v_cache, group, d),
            block_mask=block_mask, scale=scale, enable_gqa=True,
        )  # fmt: skip
        return out[:, :, 0]

    class FlexBackend(SdpaWithKernel):
        """All decodes in one flex call (the swapped kernel), then the prefills redone by flex."""

        def __call__(self, q, k_cache, v_cache, meta, scale):
            out = super().__call__(q, k_cache, v_cache, meta, scale)
            return flex_prefills(out, q, k_cache, v_cache, meta, scale)

    def flex_prefills(out, q, k_cache, v_cache, meta, scale):
        starts = meta.query_start_loc_list
        for r, q_len in enumerate(meta.query_lens):
            if q_len == 1:
                continue
            seq_len = meta.seq_lens_list[r]
            n = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
            table = meta.block_tables[r, :n]
            keys = k_cache.index_select(0, table).flatten(0, 1)[:seq_len].transpose(0, 1)[None]
            values = v_cache.index_select(0, table).flatten(0, 1)[:seq_len].transpose(0, 1)[None]
            offset = seq_len - q_len

            def causal(b, h, q_idx, kv_idx, offset=offset):
                return kv_idx <= q_idx + offset

            block_mask = create_block_mask(causal, 1, None, q_len, seq_len, device="cpu")
            qh = q[starts[r] : starts[r + 1]].transpose(0, 1)[None]
            o = flex(qh, keys, values, block_mask=block_mask, scale=scale, enable_gqa=True)
            out[starts[r] : starts[r + 1]] = o[0].transpose(0, 1)
        return out

    return FlexBackend("_sdpa_decode_group", decode, decode_group=1 << 30, cascade=False)
