"""How a step's decodes are attended: padded groups, and cascades over shared prefixes.

A decode (a single-token query) is either "plain", attended over its whole context in
a padded group of decodes (one SDPA call per group), or a member of a cascade group:
decodes whose block tables start with the same physical blocks, i.e. a shared cached
prefix. A cascade group reads its prefix K/V once for all members (one attention call
over all their queries that also returns each row's log-sum-exp), then each member
attends over its own remaining blocks.

The two partial softmaxes are merged exactly inside the second SDPA call: a member's
prefix result (output o, log-sum-exp L, per query head) enters as one extra key per
query row with score L (a zero key plus an additive mask of L) and value o, visible
to that row only. Softmax over [own keys, pseudo key] then weighs o by
e^L / (e^L + sum_own e^s), which is exactly the log-sum-exp merge
(o1 e^{L1-m} + o2 e^{L2-m}) / (e^{L1-m} + e^{L2-m}); SDPA does it in float32 and
with its fast kernel, where an explicit merge needs a slower explicit suffix pass.

`plan_decodes` makes the plan once per step (host-side numpy, then small index and
mask tensors on the device); the SDPA backend runs it at every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata

# Padded keys per decode SDPA call on CPU, measured in bench/attention_bench.py
# (bench/attention.md): 4 SmolLM2 requests of ~600 tokens, ~2-4 MB of K/V, about one
# core's L2.
CPU_DECODE_KEYS = 2560


@dataclass(frozen=True)
class CascadeGroup:
    """Decode requests whose block tables begin with the same ``shared_blocks`` physical blocks."""

    requests: tuple[int, ...]  # indices into the batch
    shared_blocks: int


@dataclass
class DecodeGroup:
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
class PrefixBatch:
    """Cascade groups whose shared prefixes are attended together (padded to the largest)."""

    q_index: torch.Tensor  # [groups * members] token index of each query (padding repeats one)
    flat_block_table: torch.Tensor  # [groups * blocks] int64
    num_groups: int
    max_members: int
    prefix_len: int  # blocks * block_size
    key_bias: torch.Tensor | None  # float [groups, 1, 1, prefix_len]: 0 / -inf, None if unpadded


@dataclass
class DecodePlan:
    """A step's decodes: plain groups, and cascade groups as prefix batches + suffix groups."""

    plain: list[DecodeGroup]
    cascade: list[CascadeGroup]
    prefix_batches: list[PrefixBatch]
    # Row of each cascade member's prefix result (prefix batches' rows concatenated),
    # in the order of the suffix groups' members.
    carry_index: torch.Tensor | None
    suffix: list[DecodeGroup]


def plan_decodes(
    meta: AttentionMetadata,
    group_size: int | None,
    use_cascade: bool,
    num_kv_heads: int,
    queries_per_kv: int,
    window: int | None = None,
) -> DecodePlan:
    """How this step's decodes are attended (``group_size`` decodes per call, None: by
    device); under a sliding window (no cascade) each reads from its window's first block."""
    device = meta.block_tables.device
    groups = cascade_groups(meta) if use_cascade else []
    in_cascade = {r for g in groups for r in g.requests}
    bs, lens = meta.block_size, meta.seq_lens_list
    plain_entries = [
        (r, 0 if window is None else max(0, lens[r] - window) // bs)
        for r, n in enumerate(meta.query_lens)
        if n == 1 and r not in in_cascade
    ]
    plan = DecodePlan(
        plain=_decode_groups(meta, group_size, plain_entries, window=window),
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
    return plan


# --------------------------------------------------------------------------- cascade groups


def cascade_groups(meta: AttentionMetadata) -> list[CascadeGroup]:
    """The step's decodes that share leading physical blocks.

    Only whole blocks strictly before each member's last token are shared, so every
    member keeps at least one token of its own (prefix caching only shares full
    blocks, and a decode writes its new token into a block of its own).
    """
    table = meta.block_tables_host
    cap = (np.asarray(meta.seq_lens_list, dtype=np.int64) - 1) // meta.block_size
    candidates = [r for r, n in enumerate(meta.query_lens) if n == 1 and cap[r] > 0]
    if len(candidates) < 2:
        return []
    # Sorted block tables put every shared prefix in a run of consecutive rows.
    rows = sorted(candidates, key=lambda r: table[r, : cap[r]].tolist())
    _, runs = _best_runs(_common_blocks(table, rows, cap), 0, len(rows) - 1)
    return [CascadeGroup(tuple(sorted(rows[lo : hi + 1])), s) for lo, hi, s in runs]


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


# --------------------------------------------------------------------------- decode groups


def _decode_groups(
    meta: AttentionMetadata,
    group_size: int | None,
    entries: list[tuple[int, int]],
    extra_blocks: int = 0,
    heads: tuple[int, int] = (1, 1),
    window: int | None = None,
) -> list[DecodeGroup]:
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
    groups: list[DecodeGroup] = []
    for lo, hi in _group_bounds(own_blocks.tolist(), bs, group_size, key_budget):
        blocks = int(own_blocks[lo:hi].max())
        # Each row: the request's own blocks, then repeats of its last one (masked).
        cols = np.minimum(np.arange(blocks + extra_blocks), own_blocks[lo:hi, None] - 1)
        table = meta.block_tables_host[reqs[lo:hi, None], first[lo:hi, None] + cols]
        keys = torch.arange((blocks + extra_blocks) * bs, device=device)
        own_keys = torch.from_numpy(own[lo:hi]).to(device)[:, None]
        valid = keys[None, :] < own_keys
        windowed = window is not None and bool((own[lo:hi] > window).any())
        if windowed:  # the keys before each row's window, in its first block
            valid &= keys[None, :] >= own_keys - window
        if extra_blocks:
            mask = additive_mask(valid)[:, None, None, :].repeat(1, *heads, 1)
        else:
            full = (own[lo:hi] == blocks * bs).all() and not windowed
            mask = None if full else valid[:, None, None, :]
        token_slice, token_index = _token_selector(meta, reqs[lo:hi].tolist(), device)
        groups.append(
            DecodeGroup(
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


# --------------------------------------------------------------------------- prefix batches


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
) -> PrefixBatch:
    """Query tokens and prefix blocks of a batch of groups, padded to its largest group."""
    bs = meta.block_size
    members = max(len(g.requests) for g in batch)
    blocks = max(g.shared_blocks for g in batch)
    q_tokens, table = [], []
    for g in batch:
        tokens = [meta.query_start_loc_list[r] for r in g.requests]
        q_tokens += tokens + [tokens[0]] * (members - len(tokens))
        ids = meta.block_tables_host[g.requests[0], : g.shared_blocks].tolist()
        table += ids + [ids[0]] * (blocks - len(ids))
    key_bias = None
    if any(g.shared_blocks != blocks for g in batch):
        shared = torch.tensor([g.shared_blocks * bs for g in batch], device=device)
        valid = torch.arange(blocks * bs, device=device)[None, :] < shared[:, None]
        key_bias = torch.zeros(valid.shape, dtype=torch.float32, device=device)
        key_bias = key_bias.masked_fill_(~valid, float("-inf"))[:, None, None, :]
    return PrefixBatch(
        q_index=torch.tensor(q_tokens, device=device),
        flat_block_table=torch.tensor(table, dtype=torch.int64, device=device),
        num_groups=len(batch),
        max_members=members,
        prefix_len=blocks * bs,
        key_bias=key_bias,
    )


def additive_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A bool keep-mask as an additive float32 one (0 kept, -inf hidden); None or a float
    mask as it is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )
