"""Paged attention over a block-structured KV cache, on flat (unpadded) token batches.

Per layer the cache is a K and a V tensor of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. A step's tokens are the
requests' new tokens concatenated; :class:`AttentionMetadata` says where each
request's tokens start, how long its context is after the step, which physical
blocks hold its keys and which cache slot each new token's K/V goes to.

Query ``i`` of a request with query length ``L`` and context length ``S`` sits at
position ``S - L + i`` and attends to keys ``0 .. S - L + i`` (causal over cached
prefix + new tokens). A decode is simply ``L == 1``: it attends to all ``S`` keys.

Two backends share one signature ``(q, k_cache, v_cache, meta, scale) -> out``:

* ``reference``: per request, gather its keys and compute
  ``softmax(q k^T * scale + causal mask) v`` explicitly in float32. Slow, obvious.
* ``sdpa`` (the default, "auto"): single-token queries (decodes) are attended in
  groups, one padded ``scaled_dot_product_attention`` call per group with a
  key-padding mask (the query heads of a KV head become that call's query rows,
  so GQA needs no K/V repeat); on CPU a group is 4 requests, so its gathered K/V
  stays in cache, elsewhere all decodes go in one call. Each multi-token query
  (prefill, chunk) gets its own SDPA call with a causal mask offset by its cached
  prefix. bench/attention_bench.py compares it with the alternatives and
  bench/attention.md has the numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "AttentionMetadata",
    "allocate_kv_cache",
    "write_kv",
    "reference_paged_attention",
    "sdpa_paged_attention",
    "make_sdpa_backend",
    "paged_attention",
    "get_attention_backend",
    "ATTENTION_BACKENDS",
]


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed (K, V) pair of ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Zeroed rather than empty: padded gathers read unused slots, and NaN garbage
    # there would survive a -inf mask as NaN * 0 in the value product.
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's flat batch of B requests and T tokens.

    Requests may come in any order; putting decodes (query length 1) first lets
    the fast backend take them as a slice instead of an index gather.
    """

    slot_mapping: (
        torch.Tensor
    )  # [T] int64: flat cache slot (block_id * block_size + offset) per token
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32: context length after this step (computed + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    positions: torch.Tensor  # [T] int64: position of each token in its sequence
    query_lens: list[int]
    seq_lens_list: list[int]
    query_start_loc_list: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    num_decodes: int  # requests with query length 1 (anywhere in the batch)
    # Per-step tensors derived lazily by a backend and shared by all layers.
    _derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_list[-1]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Build the step's metadata; positions and slots are computed vectorised in numpy.

        Request ``r`` computes tokens at positions ``seq_lens[r] - query_lens[r] ..
        seq_lens[r] - 1``; each token's slot is looked up in ``block_tables[r]``.
        """
        num_reqs = len(query_lens)
        if not (len(seq_lens) == len(block_tables) == num_reqs):
            raise ValueError(
                "query_lens, seq_lens and block_tables must have one entry per request"
            )
        q_lens = np.asarray(query_lens, dtype=np.int64)
        s_lens = np.asarray(seq_lens, dtype=np.int64)
        if num_reqs and (q_lens.min() < 1 or (s_lens < q_lens).any()):
            raise ValueError("each request needs query_len >= 1 and seq_len >= query_len")
        q_start = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=q_start[1:])
        num_tokens = int(q_start[-1])

        max_blocks = max((len(t) for t in block_tables), default=0)
        table = np.zeros((num_reqs, max(max_blocks, 1)), dtype=np.int64)
        for r, row in enumerate(block_tables):
            table[r, : len(row)] = row

        # Token t of request r: offset within the request's new tokens, then position.
        req_of_token = np.repeat(np.arange(num_reqs), q_lens)
        offset = np.arange(num_tokens) - q_start[:-1][req_of_token]
        positions = (s_lens - q_lens)[req_of_token] + offset
        if (
            num_reqs
            and ((s_lens + block_size - 1) // block_size > [len(t) for t in block_tables]).any()
        ):
            raise ValueError("a block table is too short for its request's seq_len")
        blocks = table[req_of_token, positions // block_size]
        slots = blocks * block_size + positions % block_size

        def to_dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(a).to(device=device, dtype=dtype)

        return cls(
            slot_mapping=to_dev(slots, torch.int64),
            query_start_loc=to_dev(q_start, torch.int32),
            seq_lens=to_dev(s_lens, torch.int32),
            block_tables=to_dev(table, torch.int32),
            positions=to_dev(positions, torch.int64),
            query_lens=[int(x) for x in query_lens],
            seq_lens_list=[int(x) for x in seq_lens],
            query_start_loc_list=q_start.tolist(),
            max_query_len=int(q_lens.max()) if num_reqs else 0,
            max_seq_len=int(s_lens.max()) if num_reqs else 0,
            block_size=block_size,
            num_decodes=int((q_lens == 1).sum()),
        )


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the step's new keys/values ``[T, num_kv_heads, head_dim]`` at their flat slots."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather_request_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first ``seq_len`` cached entries of one request, ``[seq_len, kvh, d]`` (a copy)."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table_row[:num_blocks])
    return blocks.flatten(0, 1)[:seq_len]


AttentionBackend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor
]

# --------------------------------------------------------------------------- reference


def reference_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Plain per-request attention in float32 with an explicit causal mask."""
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for r in range(meta.num_reqs):
        start, end = meta.query_start_loc_list[r], meta.query_start_loc_list[r + 1]
        q_len, seq_len = end - start, meta.seq_lens_list[r]
        keys = _gather_request_kv(k_cache, meta.block_tables[r], seq_len).float()
        values = _gather_request_kv(v_cache, meta.block_tables[r], seq_len).float()
        # Query head h reads KV head h // group.
        keys = keys.repeat_interleave(group, dim=1)  # [S, h, d]
        values = values.repeat_interleave(group, dim=1)
        qr = q[start:end].float()  # [L, h, d]
        scores = torch.einsum("lhd,shd->hls", qr, keys) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        allowed = k_pos[None, :] <= q_pos[:, None]  # [L, S]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hls,shd->lhd", probs, values).to(q.dtype)
    return out


# --------------------------------------------------------------------------- fast (SDPA)


@dataclass
class _DecodeGroup:
    """Up to ``decode_group`` single-token queries attended in one SDPA call."""

    token_slice: slice | None  # the group's tokens are a contiguous run, or
    token_index: torch.Tensor | None  # their token indices otherwise
    flat_block_table: torch.Tensor  # [G * blocks of the group's longest request] int64
    padded_len: int  # key slots gathered per request (blocks * block_size)
    mask: torch.Tensor | None  # [G, 1, 1, padded_len] bool key validity; None if no padding


def _decode_groups(meta: AttentionMetadata, group_size: int | None) -> list[_DecodeGroup]:
    """Split the step's single-token queries into consecutive groups (memoised per step)."""
    key = ("decode_groups", group_size)
    if key in meta._derived:
        return meta._derived[key]
    device = meta.block_tables.device
    if group_size is None:
        group_size = CPU_DECODE_GROUP if device.type == "cpu" else 1 << 30
    reqs = [r for r, n in enumerate(meta.query_lens) if n == 1]
    groups = []
    for i in range(0, len(reqs), group_size):
        members = reqs[i : i + group_size]
        tokens = [meta.query_start_loc_list[r] for r in members]
        contiguous = tokens == list(range(tokens[0], tokens[0] + len(tokens)))
        seq_lens = [meta.seq_lens_list[r] for r in members]
        num_blocks = (max(seq_lens) + meta.block_size - 1) // meta.block_size
        padded_len = num_blocks * meta.block_size
        idx = torch.tensor(members, device=device)
        tables = meta.block_tables.index_select(0, idx)[:, :num_blocks]
        mask = None
        if any(n != padded_len for n in seq_lens):
            key_pos = torch.arange(padded_len, device=device)
            valid = key_pos[None, :] < meta.seq_lens.index_select(0, idx)[:, None]
            mask = valid.view(len(members), 1, 1, padded_len)
        groups.append(
            _DecodeGroup(
                token_slice=slice(tokens[0], tokens[-1] + 1) if contiguous else None,
                token_index=None if contiguous else torch.tensor(tokens, device=device),
                flat_block_table=tables.reshape(-1).long(),
                padded_len=padded_len,
                mask=mask,
            )
        )
    meta._derived[key] = groups
    return groups


class _GatherWorkspace:
    """Reused buffers for gathered K/V blocks.

    Fresh multi-megabyte tensors every layer cost page faults that, on CPU, took
    longer than the gather itself; one buffer per (device, dtype), grown on demand.
    """

    def __init__(self) -> None:
        self._buffers: dict[
            tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]
        ] = {}

    def get(self, shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        numel = 1
        for n in shape:
            numel *= n
        key = (like.device, like.dtype)
        bufs = self._buffers.get(key)
        if bufs is None or bufs[0].numel() < numel:
            bufs = tuple(torch.empty(numel, dtype=like.dtype, device=like.device) for _ in range(2))
            self._buffers[key] = bufs
        return bufs[0][:numel].view(shape), bufs[1][:numel].view(shape)


_workspace = _GatherWorkspace()


def _sdpa_decode_group(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: _DecodeGroup,
    scale: float,
) -> torch.Tensor:
    """One SDPA call for a group of single-token queries: ``[G, h, d]`` in and out."""
    size, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    idx = group.flat_block_table
    k_buf, v_buf = _workspace.get((idx.numel(), block_size, num_kv_heads, head_dim), k_cache)
    torch.index_select(k_cache, 0, idx, out=k_buf)
    torch.index_select(v_cache, 0, idx, out=v_buf)
    # [G * blocks, block_size, kvh, d] -> [G, kvh, padded_len, d] (strided view, no copy)
    keys = k_buf.view(size, group.padded_len, num_kv_heads, head_dim).transpose(1, 2)
    values = v_buf.view(size, group.padded_len, num_kv_heads, head_dim).transpose(1, 2)
    # The query heads sharing a KV head act as that head's query rows: GQA without repeat.
    qg = q.reshape(size, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=group.mask, scale=scale)
    return out.reshape(size, num_heads, head_dim)


def _causal_mask(meta: AttentionMetadata, q_len: int, seq_len: int, device: torch.device):
    """Bool mask ``[L, S]`` for queries at positions S-L.. (cached per step and shape)."""
    key = ("causal", q_len, seq_len)
    mask = meta._derived.get(key)
    if mask is None:
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=device).tril(seq_len - q_len)
        meta._derived[key] = mask
    return mask


def _sdpa_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    seq_len: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one request's L new queries ``[L, h, d]`` over its S keys."""
    q_len, num_heads, _ = q.shape
    keys = _gather_request_kv(k_cache, block_table_row, seq_len).transpose(0, 1)[None]
    values = _gather_request_kv(v_cache, block_table_row, seq_len).transpose(0, 1)[None]
    qh = q.transpose(0, 1)[None]  # [1, h, L, d]
    gqa = num_heads != keys.shape[1]
    if q_len == seq_len:  # nothing cached: SDPA's own (top-left) causal mask is right
        out = F.scaled_dot_product_attention(
            qh, keys, values, is_causal=True, scale=scale, enable_gqa=gqa
        )
    else:
        mask = _causal_mask(meta, q_len, seq_len, q.device)
        out = F.scaled_dot_product_attention(
            qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    return out[0].transpose(0, 1)


def make_sdpa_backend(decode_group: int | None = None) -> AttentionBackend:
    """SDPA backend attending single-token queries in groups of ``decode_group`` per call.

    None picks by device: small groups on CPU, where a group's gathered K/V should
    stay in cache, and all decodes in one call elsewhere (one kernel launch on GPU).
    """

    def sdpa_paged_attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Fast path: grouped SDPA for decodes, one SDPA per multi-token request."""
        # q may be a strided view into a fused QKV projection; the output is always contiguous.
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for group in _decode_groups(meta, decode_group):
            if group.token_slice is not None:
                sl = group.token_slice
                out[sl] = _sdpa_decode_group(q[sl], k_cache, v_cache, group, scale)
            else:
                qs = q.index_select(0, group.token_index)
                res = _sdpa_decode_group(qs, k_cache, v_cache, group, scale)
                out.index_copy_(0, group.token_index, res)
        starts = meta.query_start_loc_list
        for r, q_len in enumerate(meta.query_lens):
            if q_len == 1:
                continue
            start, end = starts[r], starts[r + 1]
            out[start:end] = _sdpa_prefill(
                q[start:end], k_cache, v_cache, meta.block_tables[r], meta.seq_lens_list[r],
                meta, scale,
            )  # fmt: skip
        return out

    return sdpa_paged_attention


# --------------------------------------------------------------------------- selection

# Decodes per SDPA call on CPU, measured in bench/attention_bench.py (bench/attention.md):
# 4 SmolLM2 requests of ~600 tokens gather ~2-4 MB of K/V, about one core's L2.
CPU_DECODE_GROUP = 4

sdpa_paged_attention = make_sdpa_backend()

ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    "reference": reference_paged_attention,
    "sdpa": sdpa_paged_attention,
}

# "auto" resolves to this; see bench/attention.md for the measurements behind it.
DEFAULT_BACKEND = "sdpa"

paged_attention: AttentionBackend = sdpa_paged_attention


def get_attention_backend(name: str = "auto") -> AttentionBackend:
    """The attention function called ``name`` ("auto" = the fastest proven one)."""
    key = DEFAULT_BACKEND if name == "auto" else name
    try:
        return ATTENTION_BACKENDS[key]
    except KeyError:
        choices = ", ".join(["auto", *ATTENTION_BACKENDS])
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {choices}") from None
