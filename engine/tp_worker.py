"""Tensor-parallel ranks 1..N-1, one process each, as vLLM's multiprocess executor runs them.

Rank 0 is the engine: it owns the scheduler and the KV cache manager, and each step it
broadcasts the scheduler's decision (`SchedulerOutput`) to the other ranks through
torch.distributed; every rank then runs the same forward pass on its shard (its heads,
its MLP columns, its share of the KV cache by KV heads, its slice of the vocabulary),
meeting the others in the all-reduces and the logits' all-gather. Only rank 0 samples.
A broadcast of None stops the workers.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
from typing import Any

import torch
import torch.distributed as dist

from engine.distributed import TensorParallel, broadcast_object, init_process_group

# How long rank 0 waits for the workers to join the group (they load their shards first
# on their own, so a large model's load counts against it).
JOIN_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_workers(config: Any, num_blocks: int) -> list[multiprocessing.Process]:
    """Start ranks 1..N-1 and join the process group as rank 0."""
    size = config.tensor_parallel_size
    port = _free_port()
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(
            target=run_worker,
            args=(config, rank, size, port, num_blocks),
            name=f"tp-rank-{rank}",
            daemon=True,
        )  # fmt: skip
        for rank in range(1, size)
    ]
    for worker in workers:
        worker.start()
    init_process_group(0, size, port, config.resolve_device())
    return workers


def stop_workers(workers: list[multiprocessing.Process]) -> None:
    broadcast_object(None)
    for worker in workers:
        worker.join(30)
    dist.destroy_process_group()


def run_worker(config: Any, rank: int, size: int, port: int, num_blocks: int) -> None:
    """A worker process: its shard of the model and of the KV cache, then steps until None."""
    from engine.attention import allocate_kv_cache
    from engine.llm_engine import _context_limit, build_model
    from engine.loader import load_hf_config, resolve_model_dir
    from engine.model_runner import ModelRunner

    # Ctrl-C reaches the whole process group; rank 0 decides when the workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The ranks share the machine's cores (on a GPU host each has its own device anyway).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    device = config.resolve_device()
    init_process_group(rank, size, port, device)
    model_dir = resolve_model_dir(config.model, config.cache_dir)
    hf_config = load_hf_config(model_dir)
    dtype = config.resolve_dtype(device)
    quantization = config.resolve_quantization(device, dtype, False)
    max_model_len = config.resolve_max_model_len(_context_limit(hf_config))
    torch.manual_seed(config.seed)
    tp = TensorParallel(rank, size)
    model = build_model(config, model_dir, hf_config, device, dtype, quantization,
                        max_model_len, tp)  # fmt: skip
    kv_caches = allocate_kv_cache(
        hf_config.num_hidden_layers, num_blocks, config.block_size, model.num_kv_heads,
        model.head_dim, dtype, device, config.kv_cache_quantized,
    )  # fmt: skip
    runner = ModelRunner(model, kv_caches, config.block_size, device,
                         config.max_num_batched_tokens, samples=False)  # fmt: skip
    while (step := broadcast_object(None)) is not None:
        runner.execute(step)
    dist.destroy_process_group()
