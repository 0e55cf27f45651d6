"""The SDPA backend (the default): paged attention through `scaled_dot_product_attention`.

* Decodes (single-token queries) are attended in groups, one padded SDPA call per
  group with a key-padding mask; the query heads of a KV head become that call's
  query rows, so GQA needs no K/V repeat. On CPU a group is capped at ~4 requests of
  ~600 tokens, so its gathered K/V stays in cache; elsewhere all decodes go in one
  call. Decodes that share a cached prefix are attended as a cascade: the prefix once
  for the whole group, then each member's own blocks, merged exactly through the
  log-sum-exp (see `engine.attention.decode_plan`).
* Each multi-token query (prefill, chunk) gets its own SDPA call with a causal mask
  offset by its cached prefix.

`SdpaBackend.prepare` plans the step (the decode plan, the prefills' masks); the
per-layer call gathers blocks and runs the planned calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend
from engine.attention.decode_plan import (
    DecodeGroup,
    DecodePlan,
    PrefixBatch,
    additive_mask,
    plan_decodes,
)
from engine.attention.kv_cache import dequantize_kv, gather_request_kv, is_quantized
from engine.attention.metadata import AttentionMetadata
from engine.attention.sinks import sink_scale


@dataclass
class Prefill:
    """One multi-token query (a prefill or a chunk of one) and what its SDPA call needs."""

    tokens: slice  # its rows of the step's flat batch
    block_table_row: torch.Tensor  # [max_blocks] int32
    seq_len: int
    mask: torch.Tensor | None  # bool [L, S]; None: nothing cached, SDPA's own causal mask


@dataclass
class _StepPlan:
    """What `SdpaBackend.prepare` made of one step; every layer runs it."""

    decodes: DecodePlan
    prefills: list[Prefill]


class SdpaBackend(AttentionBackend):
    """SDPA backend; ``decode_group`` plain decodes per call, ``cascade`` shared-prefix decoding.

    ``decode_group=None`` picks by device: on CPU groups capped in gathered keys, so
    a group's K/V stays in cache, and all decodes in one call elsewhere (one kernel
    launch on GPU). ``cascade=False`` attends every decode over its whole context.
    """

    attention_sinks = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        window: int | None = None,
        decode_group: int | None = None,
        cascade: bool = True,
        sinks: bool = False,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, window, sinks)
        self.decode_group = decode_group
        # A window hides a shared prefix's first keys from the later members, and a sink
        # joins a softmax once, not once per part of a cascade: no cascade.
        self.cascade = cascade and window is None and not sinks
        self._plan: _StepPlan | None = None  # the step last prepared, read by every layer

    def prepare(self, meta: AttentionMetadata) -> None:
        decodes = plan_decodes(
            meta,
            self.decode_group,
            self.cascade,
            self.num_kv_heads,
            self.num_heads // self.num_kv_heads,
            self.window,
        )
        self._plan = _StepPlan(decodes, plan_prefills(meta, window=self.window))

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decodes in groups (shared prefixes read once), one SDPA per multi-token request;
        ``sinks`` ``[h]``: the layer's attention sinks (a backend built with ``sinks``)."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("SdpaBackend.prepare(meta) must run before the step's layers")
        # q may be a strided view into a fused QKV projection; the output is always contiguous.
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        decodes = plan.decodes
        for group in decodes.plain:
            result = _sdpa_decode_group(_take(q, group), k_cache, v_cache, group, scale, sinks)
            _put(out, group, result)
        if decodes.suffix:
            prefix_out, prefix_lse = _attend_prefixes(q, k_cache, v_cache, decodes, scale)
            for group in decodes.suffix:
                rows = group.carry_rows
                result = _sdpa_cascade_suffix(
                    _take(q, group), k_cache, v_cache, group, scale,
                    prefix_out[rows], prefix_lse[rows],
                )  # fmt: skip
                _put(out, group, result)
        for prefill in plan.prefills:
            out[prefill.tokens] = sdpa_prefill(
                q[prefill.tokens], k_cache, v_cache, prefill, scale, sinks
            )
        return out


def plan_prefills(
    meta: AttentionMetadata, longer_than: int = 1, window: int | None = None
) -> list[Prefill]:
    """The step's queries of more than `longer_than` tokens (every multi-token one by
    default); requests of one shape share one causal mask. Under a sliding window each
    query's keys start at the block of its first query's first key (the blocks before it
    may be gone from the request's table), and the mask is a band."""
    device = meta.block_tables.device
    bs = meta.block_size
    masks: dict[tuple[int, int, int], torch.Tensor] = {}
    prefills = []
    starts = meta.query_start_loc_list
    for r, q_len in enumerate(meta.query_lens):
        if q_len <= longer_than:
            continue
        seq_len = meta.seq_lens_list[r]
        skip = 0  # whole blocks before every query's window
        if window is not None:
            skip = max(0, seq_len - q_len - window + 1) // bs * bs
        keys = seq_len - skip
        mask = None
        if q_len != keys or (window is not None and q_len > window):
            mask = masks.get((q_len, keys, skip))
            if mask is None:
                mask = masks[q_len, keys, skip] = _prefill_mask(q_len, keys, window, device)
        tokens = slice(starts[r], starts[r + 1])
        prefills.append(Prefill(tokens, meta.block_tables[r, skip // bs :], keys, mask))
    return prefills


def _prefill_mask(q_len: int, keys: int, window: int | None, device: torch.device) -> torch.Tensor:
    """bool ``[L, S]``: the L last of S positions each see the keys up to their own (and,
    under a sliding window, fewer than `window` positions back)."""
    mask = torch.ones(q_len, keys, dtype=torch.bool, device=device).tril(keys - q_len)
    if window is not None:
        mask &= ~torch.ones_like(mask).tril(keys - q_len - window)
    return mask


# --------------------------------------------------------------------------- gathers


class _GatherWorkspace:
    """Reused buffers for gathered K/V blocks.

    Fresh multi-megabyte tensors every layer cost page faults that, on CPU, took
    longer than the gather itself; one buffer per (device, dtype), grown on demand.
    """

    def __init__(self) -> None:
        self._buffers: dict[
            tuple[torch.device, torch.dtype, bool], tuple[torch.Tensor, torch.Tensor]
        ] = {}

    def get(self, shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        numel = 1
        for n in shape:
            numel *= n
        # Inference tensors cannot be written outside inference mode (nor normal ones
        # reused inside it without cost), so each mode keeps its own buffers.
        key = (like.device, like.dtype, torch.is_inference_mode_enabled())
        bufs = self._buffers.get(key)
        if bufs is None or bufs[0].numel() < numel:
            bufs = tuple(torch.empty(numel, dtype=like.dtype, device=like.device) for _ in range(2))
            self._buffers[key] = bufs
        return bufs[0][:numel].view(shape), bufs[1][:numel].view(shape)


_workspace = _GatherWorkspace()


def _gather_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    flat_block_table: torch.Tensor,
    rows: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks gathered into the workspace as ``[rows, keys per row, kvh, d]`` K and V (an
    int8 cache's rows dequantized to dtype: new tensors)."""
    _, block_size, num_kv_heads, row = k_cache.shape
    n = flat_block_table.numel()
    block_numel = block_size * num_kv_heads * row
    k_buf, v_buf = _workspace.get((n, block_numel), k_cache)
    # Blocks as flat rows: index_select copies 2-D rows faster than 4-D slices.
    torch.index_select(k_cache.view(-1, block_numel), 0, flat_block_table, out=k_buf)
    torch.index_select(v_cache.view(-1, block_numel), 0, flat_block_table, out=v_buf)
    shape = (rows, n // rows * block_size, num_kv_heads, row)
    keys, values = k_buf.view(shape), v_buf.view(shape)
    if is_quantized(k_cache):
        return dequantize_kv(keys, dtype), dequantize_kv(values, dtype)
    return keys, values


def _as_float32(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered K/V in float32: as they are, or copied into the float32 workspace."""
    if keys.dtype == torch.float32:
        return keys, values
    k32, v32 = _workspace.get(tuple(keys.shape), keys.new_empty((), dtype=torch.float32))
    return k32.copy_(keys), v32.copy_(values)


def _take(q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
    if group.token_slice is not None:
        return q[group.token_slice]
    return q.index_select(0, group.token_index)


def _put(out: torch.Tensor, group: DecodeGroup, result: torch.Tensor) -> None:
    if group.token_slice is not None:
        out[group.token_slice] = result
    else:
        out.index_copy_(0, group.token_index, result)


# --------------------------------------------------------------------------- decodes


def _sdpa_decode_group(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One SDPA call for a group of single-token queries: ``[G, h, d]`` in and out."""
    size, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    keys, values = _gather_blocks(k_cache, v_cache, group.flat_block_table, size, q.dtype)
    # The query heads sharing a KV head act as that head's query rows: GQA without repeat.
    qg = q.reshape(size, num_kv_heads, num_heads // num_kv_heads, head_dim)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    if sinks is not None:
        out, lse = attention_with_lse(qg, keys, values, additive_mask(group.mask), scale)
        out = out * sink_scale(lse, sinks.view(num_kv_heads, -1)).to(out.dtype)[..., None]
    else:
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=group.mask, scale=scale)
    return out.reshape(size, num_heads, head_dim)


# --------------------------------------------------------------------------- cascade


def _attend_prefixes(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every cascade member's attention over its group's shared prefix, float32.

    Returns the normalised output ``[N, h, d]`` and log-sum-exp of the scaled scores
    ``[N, h]`` of the N members, in the order of the suffix groups.
    """
    results = [_attend_prefix_batch(q, k_cache, v_cache, b, scale) for b in plan.prefix_batches]
    out = torch.cat([o for o, _ in results]) if len(results) > 1 else results[0][0]
    lse = torch.cat([s for _, s in results]) if len(results) > 1 else results[0][1]
    return out.index_select(0, plan.carry_index), lse.index_select(0, plan.carry_index)


def _attend_prefix_batch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PrefixBatch,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ``[G*M, h, d]`` and log-sum-exp ``[G*M, h]`` of M query slots per group."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    per_kv = num_heads // num_kv_heads
    groups, members = batch.num_groups, batch.max_members
    keys, values = _gather_blocks(k_cache, v_cache, batch.flat_block_table, groups, q.dtype)
    keys, values = _as_float32(keys, values)
    # All of a group's queries that read one KV head form one matrix: [G, kvh, M * per_kv, d].
    qs = q.index_select(0, batch.q_index).view(groups, members, num_kv_heads, per_kv, head_dim)
    qs = qs.transpose(1, 2).reshape(groups, num_kv_heads, members * per_kv, head_dim).float()
    out, lse = attention_with_lse(
        qs, keys.transpose(1, 2), values.transpose(1, 2), batch.key_bias, scale
    )
    # Back to one row per query slot, heads in q's order (KV head major).
    out = out.view(groups, num_kv_heads, members, per_kv, head_dim).transpose(1, 2)
    lse = lse.view(groups, num_kv_heads, members, per_kv).transpose(1, 2)
    return out.reshape(-1, num_heads, head_dim), lse.reshape(-1, num_heads)


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention ``[B, H, L, d]`` and the log-sum-exp of each row's scaled scores.

    On CPU, torch's fused flash kernel returns both (one call instead of a dozen ops);
    elsewhere `attention_with_lse_ops`. ``mask`` is additive (float32, broadcast).
    """
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=mask, scale=scale
        )
    return attention_with_lse_ops(q, k, v, mask, scale)


def attention_with_lse_ops(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_with_lse` in plain torch ops, for any device."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v), lse


def _sdpa_cascade_suffix(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
) -> torch.Tensor:
    """Cascade members' own blocks, merged with their prefix results: ``[G, h, d]`` in and out.

    Computes in float32 whatever the cache dtype: the prefix's log-sum-exp enters
    through the mask, and rounded to bf16 it would misweigh the prefix by up to ~3%.
    """
    size, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    per_kv = num_heads // num_kv_heads
    keys, values = _gather_blocks(k_cache, v_cache, group.flat_block_table, size, q.dtype)
    keys, values = _as_float32(keys, values)
    # Query row r of KV head j sees pseudo key r (zero key, mask = its prefix lse)
    # holding its prefix output as value; the base mask hides the other pseudo keys.
    pseudo = slice(group.padded_len, group.padded_len + per_kv)
    keys[:, pseudo] = 0
    values[:, pseudo] = prefix_out.view(size, num_kv_heads, per_kv, head_dim).transpose(1, 2)
    mask = group.mask
    torch.diagonal(mask[..., pseudo], dim1=2, dim2=3).copy_(
        prefix_lse.view(size, num_kv_heads, per_kv)
    )
    qg = q.reshape(size, num_kv_heads, per_kv, head_dim).float()
    out = F.scaled_dot_product_attention(
        qg, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.reshape(size, num_heads, head_dim).to(q.dtype)


# --------------------------------------------------------------------------- prefills


def sdpa_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefill: Prefill,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of one request's L new queries ``[L, h, d]`` over its S keys."""
    num_heads = q.shape[1]
    keys = gather_request_kv(k_cache, prefill.block_table_row, prefill.seq_len, q.dtype)
    values = gather_request_kv(v_cache, prefill.block_table_row, prefill.seq_len, q.dtype)
    keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    qh = q.transpose(0, 1)[None]  # [1, h, L, d]
    gqa = num_heads != keys.shape[1]
    if sinks is not None:
        return _prefill_with_sinks(qh, keys, values, prefill, scale, sinks)
    if prefill.mask is None:  # nothing cached: SDPA's own (top-left) causal mask is right
        out = F.scaled_dot_product_attention(
            qh, keys, values, is_causal=True, scale=scale, enable_gqa=gqa
        )
    else:
        out = F.scaled_dot_product_attention(
            qh, keys, values, attn_mask=prefill.mask, scale=scale, enable_gqa=gqa
        )
    return out[0].transpose(0, 1)


def _prefill_with_sinks(
    qh: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefill: Prefill, scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """`sdpa_prefill` with the layer's sinks: the attention and its log-sum-exp (each KV head
    repeated for its query heads), then each row scaled by its keys' share."""
    q_len, seq_len = qh.shape[2], keys.shape[2]
    per_kv = qh.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(per_kv, dim=1)
    values = values.repeat_interleave(per_kv, dim=1)
    mask = prefill.mask if prefill.mask is not None else _prefill_mask(
        q_len, seq_len, None, qh.device
    )  # fmt: skip
    out, lse = attention_with_lse(qh, keys, values, additive_mask(mask)[None, None], scale)
    out = out * sink_scale(lse, sinks.view(-1, 1)).to(out.dtype)[..., None]
    return out[0].transpose(0, 1)
