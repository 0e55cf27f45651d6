"""CUDA graphs for decode steps: captured once per batch size at start-up, replayed each step.

A decode step of a small batch is bound by kernel launches on a GPU: the eager model
launches about ten kernels per layer from Python, each a few microseconds of CPU for a
few microseconds of GPU work. A CUDA graph records the whole forward once and replays it
in one launch. As in nano-vllm and vLLM, the forward is captured for decode-only batches
of a fixed set of sizes (`capture_sizes`), reading every input from persistent buffers
(`DecodeBuffers`). A step of n decodes copies its inputs into the buffers, pads them to
the next captured size and replays that size's graph; steps with prefills, and batches
above the largest size, run eagerly.

A padding row is token 0 at position 0 with context length 0 and slot -1: attention reads
no key for it and writes no K/V (the slot is skipped), so it cannot touch a real
request's blocks; its hidden state is computed and dropped.

What a graph needs of the attention backend (`AttentionBackend.cuda_graphs`): planning a
decode-only step makes no tensor and reads only host integers that the captured metadata
fixes, and the layer calls read the step from the metadata's tensors alone. The Triton
backend qualifies; SDPA (which groups requests on the host) does not.

`CudaGraphCapture` is the one place that touches CUDA; the tests give the runner a
stand-in that re-runs the captured function at replay, which checks on CPU that a
replay depends on nothing but the buffers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.config import is_cuda

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512  # larger decode batches are compute-bound: graphs gain little there

# A capture: records fn's launches and returns (replay, fn's output tensor). A replay
# writes a new result into that same tensor.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 16 up to max_num_seqs (at most
    MAX_CAPTURE_SIZE), and max_num_seqs itself. A batch runs padded to the next one."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4, 8, *range(16, top + 1, 16)) if s <= top]
    return sizes if sizes[-1] == top else [*sizes, top]


def graphs_off_reason(
    device: torch.device, enforce_eager: bool, attention_cuda_graphs: bool, tensor_parallel: bool
) -> str | None:
    """Why decode steps run eagerly here, or None: they are captured."""
    if not is_cuda(device):
        return "not on CUDA"
    if enforce_eager:
        return "--enforce-eager"
    if not attention_cuda_graphs:
        return "the attention backend plans on the host (triton captures)"
    if tensor_parallel:
        return "tensor parallelism"
    return None


class CudaGraphCapture:
    """`torch.cuda.CUDAGraph`, all sizes in one memory pool (captured largest first, as
    PyTorch recommends, so the smaller graphs reuse the largest's memory)."""

    def __init__(self) -> None:
        self.pool = None

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        fn()  # warm-up outside the capture: Triton compiles its kernels on first launch
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.pool = graph.pool()
        torch.cuda.synchronize()
        return graph.replay, out


@dataclass
class DecodeBuffers:
    """The persistent inputs every captured graph reads, sized for the largest batch.
    A step overwrites rows 0..n-1 and pads rows n..size-1."""

    input_ids: torch.Tensor  # [max] int64
    positions: torch.Tensor  # [max] int64
    slot_mapping: torch.Tensor  # [max] int64; -1 on padding rows: nothing written
    seq_lens: torch.Tensor  # [max] int32; 0 on padding rows: nothing read
    block_tables: torch.Tensor  # [max, blocks per sequence] int32
    query_start_loc: torch.Tensor  # [max + 1] int32: 0, 1, 2, ... (one token per request)

    @classmethod
    def allocate(cls, max_size: int, max_blocks: int, device: torch.device) -> DecodeBuffers:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            input_ids=zeros(max_size, dtype=torch.long),
            positions=zeros(max_size, dtype=torch.long),
            slot_mapping=torch.full((max_size,), -1, dtype=torch.long, device=device),
            seq_lens=zeros(max_size, dtype=torch.int32),
            block_tables=zeros(max_size, max_blocks, dtype=torch.int32),
            query_start_loc=torch.arange(max_size + 1, dtype=torch.int32, device=device),
        )

    def metadata(self, size: int, max_seq_len: int, block_size: int) -> AttentionMetadata:
        """The metadata a graph of `size` decodes is captured with: views of the buffers,
        and host fields that hold for any step it replays (one token each, contexts up to
        max_seq_len)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            # Backends that plan from the host table do not capture (`cuda_graphs`).
            block_tables_host=np.zeros((size, self.block_tables.shape[1]), dtype=np.int64),
            positions=self.positions[:size],
            query_lens=[1] * size,
            seq_lens_list=[max_seq_len] * size,
            query_start_loc_list=list(range(size + 1)),
            max_query_len=1,
            max_seq_len=max_seq_len,
            block_size=block_size,
            num_decodes=size,
        )

    def load(self, input_ids: torch.Tensor, meta: AttentionMetadata, size: int) -> None:
        """Copy a step of n = meta.num_reqs decodes into rows 0..n-1; pad rows n..size-1."""
        n = meta.num_reqs
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(meta.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if n < size:  # the previous step's rows must not be replayed as real requests
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].zero_()


class CudaGraphRunner:
    """The model's decode forward, captured per batch size; `run` replays the right one."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        max_blocks = -(-max_model_len // block_size)
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], max_blocks, device)
        # size -> (replay, the hidden states [size, H] each replay writes)
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self, capture: Capture | None = None) -> None:
        """Capture every size, largest first (`capture`: CudaGraphCapture by default)."""
        capture = capture if capture is not None else CudaGraphCapture()
        start = time.perf_counter()
        logger.info(
            "capturing CUDA graphs for decode batches of %d sizes (%d..%d)",
            len(self.sizes), self.sizes[0], self.sizes[-1],
        )  # fmt: skip
        for size in reversed(self.sizes):
            self._graphs[size] = capture(self._forward_fn(size))
        logger.info(
            "captured %d CUDA graphs in %.1fs", len(self._graphs), time.perf_counter() - start
        )

    def _forward_fn(self, size: int) -> Callable[[], torch.Tensor]:
        meta = self.buffers.metadata(size, self.max_model_len, self.block_size)
        input_ids = self.buffers.input_ids[:size]
        backend = self.model.attn_backend

        def forward() -> torch.Tensor:
            # Planning a decode-only step is host integers only (`cuda_graphs`), so it may
            # sit inside the capture; a stand-in capture that re-runs this needs it.
            backend.prepare(meta)
            return self.model(input_ids, meta.positions, self.kv_caches, meta)

        return forward

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def graph_size(self, meta: AttentionMetadata) -> int | None:
        """The captured size this step replays at, or None: run it eagerly."""
        if meta.num_decodes != meta.num_reqs or not self._graphs:
            return None
        return next((s for s in self.sizes if s >= meta.num_reqs and s in self._graphs), None)

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The step's hidden states ``[n, H]`` from a replay, or None where no graph fits.
        The result is a view of the graph's output: read it before the next step."""
        size = self.graph_size(meta)
        if size is None or meta.block_tables.shape[1] > self.buffers.block_tables.shape[1]:
            return None
        self.buffers.load(input_ids, meta, size)
        replay, hidden = self._graphs[size]
        replay()
        return hidden[: meta.num_reqs]
