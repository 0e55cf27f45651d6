"""Tensor parallelism over torch.distributed: one rank's place in the group, its collectives.

Megatron-style sharding (`engine/models/layers.py`, `decoder.py`): each rank holds 1/N of the query and
KV heads (and their KV cache) and of the MLP's columns; the attention output and MLP
down projections are row-parallel, so each rank's partial sum is all-reduced; the LM
head is split by vocabulary and its logits are all-gathered. The process group is gloo
on CPU, NCCL on CUDA. `engine/tp_worker.py` runs ranks 1..N-1; rank 0 is the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int

    def shard(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, columns, vocabulary rows); ValueError when
        the group size does not divide it."""
        if total % self.size:
            raise ValueError(
                f"tensor_parallel_size {self.size} does not divide {what} ({total}); "
                f"use a size that does"
            )
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in place."""
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def distributed_backend(device: torch.device) -> str:
    """torch.distributed's backend for tensor parallelism on this device: NCCL between
    CUDA devices, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(rank: int, size: int, port: int, device: torch.device) -> None:
    dist.init_process_group(
        distributed_backend(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
        world_size=size,
    )  # fmt: skip


def broadcast_object(obj: object) -> object:
    """Rank 0's `obj` on every rank (pickled by torch.distributed)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
