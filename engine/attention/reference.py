"""The reference backend: plain per-request attention in float32, the tests' oracle."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.kv_cache import gather_request_kv
from engine.attention.metadata import AttentionMetadata


def reference_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per request: gather its keys, ``softmax(q k^T * scale + causal mask) v`` in float32
    (the mask also hides keys ``window`` or more positions back, for a sliding window;
    ``sinks`` ``[h]``: each head's sink logit joins the softmax, as transformers' gpt-oss)."""
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for r in range(meta.num_reqs):
        start, end = meta.query_start_loc_list[r], meta.query_start_loc_list[r + 1]
        q_len, seq_len = end - start, meta.seq_lens_list[r]
        keys = gather_request_kv(k_cache, meta.block_tables[r], seq_len, torch.float32)
        values = gather_request_kv(v_cache, meta.block_tables[r], seq_len, torch.float32)
        # Query head h reads KV head h // group.
        keys = keys.repeat_interleave(group, dim=1)  # [S, h, d]
        values = values.repeat_interleave(group, dim=1)
        qr = q[start:end].float()  # [L, h, d]
        scores = torch.einsum("lhd,shd->hls", qr, keys) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        allowed = k_pos[None, :] <= q_pos[:, None]  # [L, S]
        if window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:  # a column of each head's sink, dropped after the softmax
            sink = sinks.float()[:, None, None].expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hls,shd->lhd", probs, values).to(q.dtype)
    return out


class ReferenceBackend(AttentionBackend):
    """`reference_paged_attention` as a backend: slow and obvious, nothing to plan."""

    attention_sinks = True

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return reference_paged_attention(q, k_cache, v_cache, meta, scale, self.window, sinks)
