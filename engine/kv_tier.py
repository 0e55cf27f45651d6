"""The KV cache's second tier on the engine's side: a block's bytes out of the pool's
tensors and back (kv_cache/host_tier.py keeps them; the KV manager decides which).

A block's bytes are every KV cache tensor's K then V rows of that block, as the tensors
hold them (float32, bf16 or int8 rows), so a block goes out and comes back bit for bit. In
a hybrid model the groups share the tensors (kv_cache/groups.py), so a block id's rows are
its own group's layers' K/V. A model with recurrent layers keeps its state snapshots in a
second tier file: a snapshot's bytes are each recurrent layer's conv then recurrent state
in that slot (engine/state_cache.py), the same copy over other tensors.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.loader import default_cache_dir
from kv_cache import BlockHash
from kv_cache.host_tier import HostTier

if TYPE_CHECKING:
    from engine.resolved_config import ResolvedConfig

logger = logging.getLogger(__name__)

# Pairs of tensors whose first dimension is the block (or state slot) id.
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
Moves = tuple[list[tuple[int, BlockHash]], dict[int, bytes]]
LAYOUT_VERSION = 1


def block_nbytes(kv_caches: KVCaches) -> int:
    return sum(k[0].nbytes + v[0].nbytes for k, v in kv_caches)


def open_tier(
    cache_dir: Path,
    capacity_bytes: int,
    kv_caches: KVCaches,
    model_dir: Path,
    block_size: int,
    kind: str = "kv",
) -> HostTier:
    """The tier file for this model and layout under `cache_dir/kv-tier`, reopened when one
    was left by an earlier run of the same model and layout. `kind`: "kv" for the KV
    blocks (`kv_caches`: the pool's distinct tensors), "state" for the state snapshots
    (`kv_caches`: each recurrent layer's pair)."""
    files = sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model_dir.iterdir() if p.is_file()
    )
    k = kv_caches[0][0]
    layout = f"{tuple(k.shape[1:])}|{k.dtype}"
    if kind != "kv":  # (a KV tier's identity is the one earlier versions wrote)
        v = kv_caches[0][1]
        layout = f"{kind}|{layout}|{tuple(v.shape[1:])}|{v.dtype}"
    identity = (
        f"pagedserve kv tier {LAYOUT_VERSION}|{model_dir.resolve()}|{files}|"
        f"{len(kv_caches)} layers|{layout}|block_size {block_size}"
    )
    name = hashlib.sha256(identity.encode()).hexdigest()[:24]
    tier = HostTier(
        cache_dir / "kv-tier" / f"{name}.bin", capacity_bytes, block_nbytes(kv_caches), identity
    )
    logger.info(
        "%s tier: %s, %d entries of %d bytes, %d kept from an earlier run",
        "KV" if kind == "kv" else "State", tier.path, tier.num_slots, tier.block_bytes,
        tier.reopened_entries,
    )  # fmt: skip
    return tier


def open_tiers(
    config: ResolvedConfig, tensors: KVCaches, states: KVCaches, tensor_parallel: bool
) -> tuple[HostTier, HostTier | None]:
    """The KV blocks' tier file and, for a model with recurrent layers, its state snapshots'
    (`kv_offload_bytes` split between them as the pool's memory is)."""
    engine = config.engine
    if tensor_parallel:
        raise ValueError("the KV tier (kv_offload_bytes) runs in one process, not under "
                         "tensor parallelism")  # fmt: skip
    if not engine.enable_prefix_caching:
        raise ValueError("the KV tier (kv_offload_bytes) needs prefix caching")
    cache_dir = Path(engine.cache_dir) if engine.cache_dir else default_cache_dir()
    capacity = engine.kv_offload_bytes
    state_tier = None
    if states:
        kv_bytes = config.num_blocks * block_nbytes(tensors)
        state_bytes = config.num_state_slots * block_nbytes(states)
        state_capacity = capacity * state_bytes // (kv_bytes + state_bytes)
        capacity -= state_capacity
        state_tier = open_tier(cache_dir, state_capacity, states, config.model_dir,
                               engine.block_size, kind="state")  # fmt: skip
    tier = open_tier(cache_dir, capacity, tensors, config.model_dir, engine.block_size)
    return tier, state_tier


def read_blocks(kv_caches: KVCaches, block_ids: list[int]) -> list[bytes]:
    """Each block's bytes, in the order given."""
    device = kv_caches[0][0].device
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    n = len(block_ids)
    parts = [t.index_select(0, index).reshape(n, -1).view(torch.uint8)
             for k, v in kv_caches for t in (k, v)]  # fmt: skip
    flat = torch.cat(parts, dim=1).cpu().numpy()
    return [flat[i].tobytes() for i in range(n)]


def write_blocks(kv_caches: KVCaches, blocks: dict[int, bytes]) -> None:
    """Write each block's bytes (as `read_blocks` gave them) into the pool's tensors."""
    device = kv_caches[0][0].device
    index = torch.tensor(list(blocks), dtype=torch.long, device=device)
    n = len(blocks)
    flat = torch.from_numpy(np.frombuffer(b"".join(blocks.values()), dtype=np.uint8).copy())
    flat = flat.view(n, -1).to(device)
    offset = 0
    for k, v in kv_caches:
        for t in (k, v):
            size = t[0].nbytes
            rows = flat[:, offset : offset + size].contiguous().view(t.dtype)
            t.index_copy_(0, index, rows.view(n, *t.shape[1:]))
            offset += size


@dataclass(frozen=True)
class TierCopies:
    """One tier file and the tensors whose rows it keeps, with the manager's calls that say
    what to copy (`take_moves`) and what the pool caches (`cached`)."""

    tier: HostTier
    tensors: KVCaches
    take_moves: Callable[[], Moves]
    cached: Callable[[], list[tuple[int, BlockHash]]]

    def move(self) -> None:
        """The moves a schedule() asked for, before its step runs: evicted blocks are read
        out (and stored) before the blocks brought back are written in, since a block can
        be both."""
        offloads, loads = self.take_moves()
        if offloads:
            datas = read_blocks(self.tensors, [block_id for block_id, _ in offloads])
            for (_, block_hash), data in zip(offloads, datas, strict=True):
                self.tier.put(block_hash, data)
        if loads:
            write_blocks(self.tensors, loads)

    def save(self) -> int:
        """Store every block the pool caches that the tier lacks (at shutdown, so a restart
        finds them); returns how many were stored."""
        self.move()
        missing = [(block_id, h) for block_id, h in self.cached() if h not in self.tier]
        # The tier keeps the most recent; store in batches to bound the staging copy.
        for start in range(0, len(missing), 256):
            batch = missing[start : start + 256]
            datas = read_blocks(self.tensors, [b for b, _ in batch])
            for (_, block_hash), data in zip(batch, datas, strict=True):
                self.tier.put(block_hash, data)
        return len(missing)
