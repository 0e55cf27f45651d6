"""Tensor-parallel ranks 1..N-1, one process each, as vLLM's multiprocess executor runs them.

Rank 0 is the engine core: it owns the scheduler and the KV cache manager, and each step
it broadcasts the scheduler's decision to the other ranks through torch.distributed, as
a diff (`WorkerStep`: a new request's block table once, then only the blocks it gains).
Every rank then runs the same forward pass on its shard (its heads, its MLP columns, its
share of the KV cache by KV heads, its slice of the vocabulary), meeting the others in
the all-reduces and the logits' all-gather. Only rank 0 samples.
A broadcast of None stops the workers.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.distributed import TensorParallel, broadcast_object, init_process_group
from engine.resolved_config import ResolvedConfig
from scheduler import ScheduledRequest, SchedulerOutput

# How long rank 0 waits for the workers to join the group (they load their shards first
# on their own, so a large model's load counts against it).
JOIN_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_workers(config: ResolvedConfig) -> list[multiprocessing.Process]:
    """Start ranks 1..N-1 and join the process group as rank 0."""
    size = config.engine.tensor_parallel_size
    port = _free_port()
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(
            target=run_worker, args=(config, rank, port), name=f"tp-rank-{rank}", daemon=True
        )
        for rank in range(1, size)
    ]
    for worker in workers:
        worker.start()
    init_process_group(0, size, port, config.device)
    return workers


def stop_workers(workers: list[multiprocessing.Process]) -> None:
    broadcast_object(None)
    for worker in workers:
        worker.join(30)
    dist.destroy_process_group()


# ------------------------------------------------------------------ the step, as a diff


@dataclass(slots=True)
class WorkerRequest:
    """One scheduled request as the other ranks need it: what to compute and where."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    new_block_ids: tuple[int, ...]  # appended to the rank's copy of its block table
    sample: bool
    # The table's length after this step: a speculative step's rejected tail was freed
    # (`KVCacheManager.trim`), so the rank's copy is cut to this before the new blocks.
    num_blocks: int
    num_draft_tokens: int


@dataclass(slots=True)
class WorkerStep:
    """What rank 0 broadcasts each step: the scheduled requests with only the blocks they
    gained (a request's whole table once, when it is admitted), and the ids whose tables
    the ranks drop. Never the `Request` objects themselves (prompt, outputs, parameters):
    pickling those whole each step grew with every request's length (vLLM's
    NewRequestData / CachedRequestData split)."""

    requests: list[WorkerRequest]
    dropped_ids: set[str]  # finished or preempted since the last step
    num_batched_tokens: int


def worker_step(out: SchedulerOutput) -> WorkerStep:
    """Rank 0: the step's diff for the other ranks."""
    requests = [
        WorkerRequest(
            s.request_id,
            s.token_ids,
            s.num_computed_tokens,
            s.block_ids[len(s.block_ids) - s.num_new_blocks :],
            s.sample,
            len(s.block_ids),
            s.num_draft_tokens,
        )
        for s in out.scheduled
    ]
    return WorkerStep(requests, out.finished_ids | out.preempted_ids, out.num_batched_tokens)


class BlockTables:
    """A rank's copy of the running requests' block tables, kept up to date by the diffs."""

    def __init__(self) -> None:
        self._tables: dict[str, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._tables)

    def apply(self, step: WorkerStep) -> SchedulerOutput:
        """The step as the model runner takes it (no `Request`: these ranks never sample)."""
        tables = self._tables
        for request_id in step.dropped_ids:
            tables.pop(request_id, None)
        scheduled = []
        for r in step.requests:
            kept = tables.get(r.request_id, ())[: r.num_blocks - len(r.new_block_ids)]
            table = tables[r.request_id] = kept + r.new_block_ids
            scheduled.append(
                ScheduledRequest(
                    None, r.request_id, r.token_ids, r.num_computed_tokens, table, r.sample,
                    num_draft_tokens=r.num_draft_tokens,
                )
            )  # fmt: skip
        return SchedulerOutput(scheduled, num_batched_tokens=step.num_batched_tokens)


# ------------------------------------------------------------------ the worker process


def run_worker(config: ResolvedConfig, rank: int, port: int) -> None:
    """A worker process: its shard of the model and of the KV cache, then steps until None."""
    from engine.attention import allocate_kv_cache
    from engine.model_loader import load_model
    from engine.model_runner import ModelRunner

    # Ctrl-C reaches the whole process group; rank 0 decides when the workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    size = config.engine.tensor_parallel_size
    # The ranks share the machine's cores (on a GPU host each has its own device anyway).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    init_process_group(rank, size, port, config.device)
    torch.manual_seed(config.engine.seed)
    model = load_model(config, TensorParallel(rank, size))
    c = config.engine
    kv_caches = allocate_kv_cache(
        config.num_layers, config.num_blocks, c.block_size, model.num_kv_heads,
        model.head_dim, config.dtype, config.device, c.kv_cache_quantized,
    )  # fmt: skip
    runner = ModelRunner(model, kv_caches, c.block_size, config.device,
                         c.max_num_batched_tokens, samples=False)  # fmt: skip
    tables = BlockTables()
    while (step := broadcast_object(None)) is not None:
        runner.execute(tables.apply(step))
    dist.destroy_process_group()
