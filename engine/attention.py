"""Paged attention over a block-structured KV cache, on flat (unpadded) token batches.

Per layer the cache is a K and a V tensor of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. A step's tokens are the
requests' new tokens concatenated; :class:`AttentionMetadata` says where each
request's tokens start, how long its context is after the step, which physical
blocks hold its keys and which cache slot each new token's K/V goes to.

Query ``i`` of a request with query length ``L`` and context length ``S`` sits at
position ``S - L + i`` and attends to keys ``0 .. S - L + i`` (causal over cached
prefix + new tokens). A decode is simply ``L == 1``: it attends to all ``S`` keys.

Backends share one signature ``(q, k_cache, v_cache, meta, scale) -> out``:

* ``reference``: per request, gather its keys and compute
  ``softmax(q k^T * scale + causal mask) v`` explicitly in float32. Slow, obvious.
* ``sdpa`` (the default, "auto"): single-token queries (decodes) are attended in
  groups, one padded ``scaled_dot_product_attention`` call per group with a
  key-padding mask (the query heads of a KV head become that call's query rows,
  so GQA needs no K/V repeat); on CPU a group is capped at ~4 requests of ~600
  tokens, so its gathered K/V stays in cache, elsewhere all decodes go in one
  call. Decodes whose block tables start with the same physical blocks (a shared
  cached prefix) are attended as a cascade: the prefix once for the whole group,
  then each member's own blocks, merged exactly through the log-sum-exp (see
  "decode plan" below). Each multi-token query (prefill, chunk) gets its own SDPA
  call with a causal mask offset by its cached prefix.
* ``sdpa-nocascade``: ``sdpa`` without the cascade, for A/B comparisons.

bench/attention_bench.py compares them with the alternatives and
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
    "CascadeGroup",
    "cascade_groups",
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
    # block_tables on the host (int64): per-step planning reads it without a device sync.
    block_tables_host: np.ndarray | None = field(default=None, repr=False, compare=False)
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
            block_tables_host=table,
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


# --------------------------------------------------------------------------- decode plan
#
# Decodes are planned once per step (at the first layer) and the plan is memoised on
# the metadata. A decode is either "plain" (attended over its whole context in padded
# groups) or a member of a cascade group: decodes whose block tables start with the
# same physical blocks, i.e. a shared cached prefix. A cascade group reads its prefix
# K/V once for all members (one attention call over all their queries that also returns
# each row's log-sum-exp), then each member attends over its own remaining blocks.
#
# The two partial softmaxes are merged exactly inside the second SDPA call: a member's
# prefix result (output o, log-sum-exp L, per query head) enters as one extra key per
# query row with score L (a zero key plus an additive mask of L) and value o, visible
# to that row only. Softmax over [own keys, pseudo key] then weighs o by
# e^L / (e^L + sum_own e^s), which is exactly the log-sum-exp merge
# (o1 e^{L1-m} + o2 e^{L2-m}) / (e^{L1-m} + e^{L2-m}); SDPA does it in float32 and
# with its fast kernel, where an explicit merge needs a slower explicit suffix pass.


@dataclass(frozen=True)
class CascadeGroup:
    """Decode requests whose block tables begin with the same ``shared_blocks`` physical blocks."""

    requests: tuple[int, ...]  # indices into the batch
    shared_blocks: int


@dataclass
class _DecodeGroup:
    """Single-token queries attended in one SDPA call, each over a run of its blocks."""

    token_slice: slice | None  # the group's tokens are a contiguous run, or
    token_index: torch.Tensor | None  # their token indices otherwise
    flat_block_table: torch.Tensor  # [G * (blocks + extra)] int64
    padded_len: int  # own key slots gathered per request (blocks * block_size)
    mask: torch.Tensor | None  # bool [G, 1, 1, keys] key validity (None: no padding), or
    # float [G, kvh, h/kvh, keys] (0 / -inf) for a cascade suffix group, whose
    # pseudo-key diagonal is rewritten with the prefix log-sum-exp at every layer
    carry_rows: slice | None = None  # cascade suffix group: its rows of the prefix results


@dataclass
class _PrefixBatch:
    """Cascade groups whose shared prefixes are attended together (padded to the largest)."""

    q_index: torch.Tensor  # [groups * members] token index of each query (padding repeats one)
    flat_block_table: torch.Tensor  # [groups * blocks] int64
    num_groups: int
    max_members: int
    prefix_len: int  # blocks * block_size
    key_bias: torch.Tensor | None  # float [groups, 1, 1, prefix_len]: 0 / -inf, None if unpadded


@dataclass
class _DecodePlan:
    """A step's decodes: plain groups, and cascade groups as prefix batches + suffix groups."""

    plain: list[_DecodeGroup]
    cascade: list[CascadeGroup]
    prefix_batches: list[_PrefixBatch]
    # Row of each cascade member's prefix result (prefix batches' rows concatenated),
    # in the order of the suffix groups' members.
    carry_index: torch.Tensor | None
    suffix: list[_DecodeGroup]


def _common_blocks(table: np.ndarray, rows: list[int], cap: np.ndarray) -> list[int]:
    """Equal leading block ids of each pair of consecutive ``rows``, capped by both caps."""
    t = table[rows]
    limit = np.minimum(cap[rows][:-1], cap[rows][1:])
    differs = (t[:-1] != t[1:]) | (np.arange(t.shape[1])[None, :] >= limit[:, None])
    # A sentinel column so that rows equal to the end count as differing there.
    differs = np.concatenate([differs, np.ones((len(rows) - 1, 1), dtype=bool)], axis=1)
    return differs.argmax(axis=1).tolist()


def _best_runs(links: list[int], lo: int, hi: int) -> tuple[int, list[tuple[int, int, int]]]:
    """Split sorted rows lo..hi into runs (lo, hi, shared) maximising blocks read once, not n times.

    ``links[i]`` is the common prefix of rows i and i+1, so a run shares the minimum of
    its links and saves ``(size - 1) * shared`` block reads. Splitting at the links
    equal to that minimum lets each part share more; keep whichever saves more.
    """
    if lo == hi:
        return 0, []
    shared = min(links[lo:hi])
    saved, runs, start = 0, [], lo
    for k in [*(k for k in range(lo, hi) if links[k] == shared), hi]:
        part_saved, part_runs = _best_runs(links, start, k)
        saved += part_saved
        runs += part_runs
        start = k + 1
    whole = (hi - lo) * shared
    if shared > 0 and whole >= saved:
        return whole, [(lo, hi, shared)]
    return saved, runs


def cascade_groups(meta: AttentionMetadata) -> list[CascadeGroup]:
    """The step's decodes that share leading physical blocks (memoised per step).

    Only whole blocks strictly before each member's last token are shared, so every
    member keeps at least one token of its own (prefix caching only shares full
    blocks, and a decode writes its new token into a block of its own).
    """
    key = "cascade_groups"
    if key in meta._derived:
        return meta._derived[key]
    table = _host_table(meta)
    cap = (np.asarray(meta.seq_lens_list, dtype=np.int64) - 1) // meta.block_size
    candidates = [r for r, n in enumerate(meta.query_lens) if n == 1 and cap[r] > 0]
    groups: list[CascadeGroup] = []
    if len(candidates) >= 2:
        # Sorted block tables put every shared prefix in a run of consecutive rows.
        rows = sorted(candidates, key=lambda r: table[r, : cap[r]].tolist())
        _, runs = _best_runs(_common_blocks(table, rows, cap), 0, len(rows) - 1)
        groups = [CascadeGroup(tuple(sorted(rows[lo : hi + 1])), s) for lo, hi, s in runs]
    meta._derived[key] = groups
    return groups


def _decode_groups(
    meta: AttentionMetadata,
    group_size: int | None,
    entries: list[tuple[int, int]],
    extra_blocks: int = 0,
    heads: tuple[int, int] = (1, 1),
) -> list[_DecodeGroup]:
    """Pack decodes, given as (request, first block to attend), into SDPA calls.

    ``extra_blocks > 0`` makes cascade suffix groups: after each request's own
    blocks, that many more key blocks whose first slots receive the pseudo keys
    carrying the prefix result, and a float mask ``[G, *heads, keys]`` where heads
    is (KV heads, query heads per KV head).
    """
    if not entries:
        return []
    device = meta.block_tables.device
    bs = meta.block_size
    reqs = np.array([r for r, _ in entries], dtype=np.int64)
    first = np.array([b for _, b in entries], dtype=np.int64)
    own = np.asarray(meta.seq_lens_list, dtype=np.int64)[reqs] - first * bs  # keys to attend
    own_blocks = -(-own // bs)
    # A tuning choice: on CPU a group's gathered K/V should stay in cache, so groups
    # are capped in padded keys; elsewhere one call takes every decode.
    key_budget = CPU_DECODE_KEYS if group_size is None and device.type == "cpu" else None
    groups: list[_DecodeGroup] = []
    for lo, hi in _group_bounds(own_blocks.tolist(), bs, group_size, key_budget):
        blocks = int(own_blocks[lo:hi].max())
        # Each row: the request's own blocks, then repeats of its last one (masked).
        cols = np.minimum(np.arange(blocks + extra_blocks), own_blocks[lo:hi, None] - 1)
        table = _host_table(meta)[reqs[lo:hi, None], first[lo:hi, None] + cols]
        keys = torch.arange((blocks + extra_blocks) * bs, device=device)
        valid = keys[None, :] < torch.from_numpy(own[lo:hi]).to(device)[:, None]
        if extra_blocks:
            mask = torch.zeros(valid.shape, dtype=torch.float32, device=device)
            mask = mask.masked_fill_(~valid, float("-inf"))
            mask = mask[:, None, None, :].repeat(1, *heads, 1)
        else:
            mask = None if (own[lo:hi] == blocks * bs).all() else valid[:, None, None, :]
        token_slice, token_index = _token_selector(meta, reqs[lo:hi].tolist(), device)
        groups.append(
            _DecodeGroup(
                token_slice=token_slice,
                token_index=token_index,
                flat_block_table=torch.from_numpy(table.reshape(-1)).to(device),
                padded_len=blocks * bs,
                mask=mask,
                carry_rows=slice(lo, hi) if extra_blocks else None,
            )
        )
    return groups


def _group_bounds(
    own_blocks: list[int], block_size: int, group_size: int | None, key_budget: int | None
) -> list[tuple[int, int]]:
    """Consecutive groups: ``group_size`` requests each, or as many as keep (members x
    longest padded length) within ``key_budget`` (at least one), or all in one."""
    n = len(own_blocks)
    if group_size is not None:
        return [(lo, min(lo + group_size, n)) for lo in range(0, n, group_size)]
    if key_budget is None:
        return [(0, n)]
    bounds, lo, longest = [], 0, 0
    for i, blocks in enumerate(own_blocks):
        longest = max(longest, blocks * block_size)
        if i > lo and (i + 1 - lo) * longest > key_budget:
            bounds.append((lo, i))
            lo, longest = i, blocks * block_size
    bounds.append((lo, n))
    return bounds


def _token_selector(
    meta: AttentionMetadata, reqs: list[int], device: torch.device
) -> tuple[slice | None, torch.Tensor | None]:
    """The requests' (single) tokens as a slice when contiguous, else an index tensor."""
    tokens = [meta.query_start_loc_list[r] for r in reqs]
    if tokens == list(range(tokens[0], tokens[0] + len(tokens))):
        return slice(tokens[0], tokens[-1] + 1), None
    return None, torch.tensor(tokens, device=device)


def _pack_prefix_batches(groups: list[CascadeGroup]) -> list[list[CascadeGroup]]:
    """Batch cascade groups for the prefix pass while padding adds at most half the work.

    A batch is padded to its most members and longest prefix; a separate batch
    costs only a dozen more small ops, so it wins once padding costs more.
    """
    batches: list[list[CascadeGroup]] = []
    for group in sorted(groups, key=lambda g: (len(g.requests), g.shared_blocks), reverse=True):
        if batches:
            candidate = [*batches[-1], group]
            members = max(len(g.requests) for g in candidate)
            blocks = max(g.shared_blocks for g in candidate)
            work = sum(len(g.requests) * g.shared_blocks for g in candidate)
            if 2 * len(candidate) * members * blocks <= 3 * work:
                batches[-1] = candidate
                continue
        batches.append([group])
    return batches


def _prefix_batch(
    meta: AttentionMetadata, batch: list[CascadeGroup], device: torch.device
) -> _PrefixBatch:
    """Query tokens and prefix blocks of a batch of groups, padded to its largest group."""
    bs = meta.block_size
    members = max(len(g.requests) for g in batch)
    blocks = max(g.shared_blocks for g in batch)
    q_tokens, table = [], []
    for g in batch:
        tokens = [meta.query_start_loc_list[r] for r in g.requests]
        q_tokens += tokens + [tokens[0]] * (members - len(tokens))
        ids = _host_table(meta)[g.requests[0], : g.shared_blocks].tolist()
        table += ids + [ids[0]] * (blocks - len(ids))
    key_bias = None
    if any(g.shared_blocks != blocks for g in batch):
        shared = torch.tensor([g.shared_blocks * bs for g in batch], device=device)
        valid = torch.arange(blocks * bs, device=device)[None, :] < shared[:, None]
        key_bias = torch.zeros(valid.shape, dtype=torch.float32, device=device)
        key_bias = key_bias.masked_fill_(~valid, float("-inf"))[:, None, None, :]
    return _PrefixBatch(
        q_index=torch.tensor(q_tokens, device=device),
        flat_block_table=torch.tensor(table, dtype=torch.int64, device=device),
        num_groups=len(batch),
        max_members=members,
        prefix_len=blocks * bs,
        key_bias=key_bias,
    )


def _decode_plan(
    meta: AttentionMetadata,
    group_size: int | None,
    use_cascade: bool,
    num_kv_heads: int,
    queries_per_kv: int,
) -> _DecodePlan:
    """How this step's decodes are attended (memoised per step, shared by all layers)."""
    key = ("decode_plan", group_size, use_cascade, num_kv_heads, queries_per_kv)
    if key in meta._derived:
        return meta._derived[key]
    device = meta.block_tables.device
    groups = cascade_groups(meta) if use_cascade else []
    in_cascade = {r for g in groups for r in g.requests}
    plain_entries = [
        (r, 0) for r, n in enumerate(meta.query_lens) if n == 1 and r not in in_cascade
    ]
    plan = _DecodePlan(
        plain=_decode_groups(meta, group_size, plain_entries),
        cascade=groups,
        prefix_batches=[],
        carry_index=None,
        suffix=[],
    )
    if groups:
        row_of: dict[int, int] = {}
        for batch in _pack_prefix_batches(groups):
            prefix = _prefix_batch(meta, batch, device)
            base = sum(b.num_groups * b.max_members for b in plan.prefix_batches)
            for i, g in enumerate(batch):
                for j, r in enumerate(g.requests):
                    row_of[r] = base + i * prefix.max_members + j
            plan.prefix_batches.append(prefix)
        # Members in order of own length, so suffix groups pad little.
        members = sorted(
            ((r, g.shared_blocks) for g in groups for r in g.requests),
            key=lambda e: meta.seq_lens_list[e[0]] - e[1] * meta.block_size,
        )
        plan.carry_index = torch.tensor([row_of[r] for r, _ in members], device=device)
        extra_blocks = -(-queries_per_kv // meta.block_size)
        plan.suffix = _decode_groups(
            meta, group_size, members, extra_blocks, (num_kv_heads, queries_per_kv)
        )
    meta._derived[key] = plan
    return plan


def _host_table(meta: AttentionMetadata) -> np.ndarray:
    """Block tables as a host array (the builder keeps one; otherwise one device read)."""
    if meta.block_tables_host is None:
        meta.block_tables_host = np.asarray(meta.block_tables.tolist(), dtype=np.int64)
    return meta.block_tables_host


# --------------------------------------------------------------------------- fast (SDPA)


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
    k_cache: torch.Tensor, v_cache: torch.Tensor, flat_block_table: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks gathered into the workspace as ``[rows, keys per row, kvh, d]`` K and V."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    n = flat_block_table.numel()
    block_numel = block_size * num_kv_heads * head_dim
    k_buf, v_buf = _workspace.get((n, block_numel), k_cache)
    # Blocks as flat rows: index_select copies 2-D rows faster than 4-D slices.
    torch.index_select(k_cache.view(-1, block_numel), 0, flat_block_table, out=k_buf)
    torch.index_select(v_cache.view(-1, block_numel), 0, flat_block_table, out=v_buf)
    shape = (rows, n // rows * block_size, num_kv_heads, head_dim)
    return k_buf.view(shape), v_buf.view(shape)


def _as_float32(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered K/V in float32: as they are, or copied into the float32 workspace."""
    if keys.dtype == torch.float32:
        return keys, values
    k32, v32 = _workspace.get(tuple(keys.shape), keys.new_empty((), dtype=torch.float32))
    return k32.copy_(keys), v32.copy_(values)


def _sdpa_decode_group(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: _DecodeGroup,
    scale: float,
) -> torch.Tensor:
    """One SDPA call for a group of single-token queries: ``[G, h, d]`` in and out."""
    size, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    keys, values = _gather_blocks(k_cache, v_cache, group.flat_block_table, size)
    # The query heads sharing a KV head act as that head's query rows: GQA without repeat.
    qg = q.reshape(size, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        qg, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=group.mask, scale=scale
    )
    return out.reshape(size, num_heads, head_dim)


def _attend_prefixes(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _DecodePlan, scale: float
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
    batch: _PrefixBatch,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ``[G*M, h, d]`` and log-sum-exp ``[G*M, h]`` of M query slots per group."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    per_kv = num_heads // num_kv_heads
    groups, members = batch.num_groups, batch.max_members
    keys, values = _gather_blocks(k_cache, v_cache, batch.flat_block_table, groups)
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
    group: _DecodeGroup,
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
    keys, values = _gather_blocks(k_cache, v_cache, group.flat_block_table, size)
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


def _take(q: torch.Tensor, group: _DecodeGroup) -> torch.Tensor:
    if group.token_slice is not None:
        return q[group.token_slice]
    return q.index_select(0, group.token_index)


def _put(out: torch.Tensor, group: _DecodeGroup, result: torch.Tensor) -> None:
    if group.token_slice is not None:
        out[group.token_slice] = result
    else:
        out.index_copy_(0, group.token_index, result)


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


def make_sdpa_backend(decode_group: int | None = None, cascade: bool = True) -> AttentionBackend:
    """SDPA backend; ``decode_group`` plain decodes per call, ``cascade`` shared-prefix decoding.

    ``decode_group=None`` picks by device: on CPU groups capped in gathered keys, so
    a group's K/V stays in cache, and all decodes in one call elsewhere (one kernel
    launch on GPU). ``cascade=False`` attends every decode over its whole context.
    """

    def sdpa_paged_attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Decodes in groups (shared prefixes read once), one SDPA per multi-token request."""
        # q may be a strided view into a fused QKV projection; the output is always contiguous.
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            num_kv_heads = k_cache.shape[2]
            plan = _decode_plan(
                meta, decode_group, cascade, num_kv_heads, q.shape[1] // num_kv_heads
            )
            for group in plan.plain:
                result = _sdpa_decode_group(_take(q, group), k_cache, v_cache, group, scale)
                _put(out, group, result)
            if plan.suffix:
                prefix_out, prefix_lse = _attend_prefixes(q, k_cache, v_cache, plan, scale)
                for group in plan.suffix:
                    rows = group.carry_rows
                    result = _sdpa_cascade_suffix(
                        _take(q, group), k_cache, v_cache, group, scale,
                        prefix_out[rows], prefix_lse[rows],
                    )  # fmt: skip
                    _put(out, group, result)
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

# Padded keys per decode SDPA call on CPU, measured in bench/attention_bench.py
# (bench/attention.md): 4 SmolLM2 requests of ~600 tokens, ~2-4 MB of K/V, about one
# core's L2.
CPU_DECODE_KEYS = 2560

sdpa_paged_attention = make_sdpa_backend()

ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    "reference": reference_paged_attention,
    "sdpa": sdpa_paged_attention,
    # Every decode over its whole context, shared prefixes or not: for A/B runs.
    "sdpa-nocascade": make_sdpa_backend(cascade=False),
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
