"""CUDA graphs for decode steps: captured once per batch size at start-up, replayed each step.

A decode step of a small batch is bound by kernel launches on a GPU: the eager model
launches about ten kernels per layer from Python, each a few microseconds of CPU for a
few microseconds of GPU work. A CUDA graph records the whole forward once and replays it
in one launch. As in nano-vllm and vLLM, the forward is captured for decode-only batches
of a fixed set of sizes (`capture_sizes`), reading every input from persistent buffers
(`DecodeBuffers`). A step of n decodes writes its inputs into the buffers' host twins,
pads them to the next captured size, copies them over in two copies and replays that
size's graph (no `AttentionMetadata` is built for it); steps with prefills, and batches
above the largest size, run eagerly.

A padding row is token 0 at position 0 with context length 0 and slot -1: attention reads
no key for it and writes no K/V (the slot is skipped), so it cannot touch a real
request's blocks; its hidden state is computed and dropped.

What a graph needs of the attention backend (`AttentionBackend.cuda_graphs`): planning a
decode-only step makes no tensor and reads only host integers that the captured metadata
fixes, and the layer calls read the step from the metadata's tensors alone. The Triton
backend qualifies; SDPA (which groups requests on the host) does not. A sliding window is
a constant of the backend (its kernels' and its splits'), so a windowed model captures
too; a hybrid one (several KV cache groups, kv_cache/groups.py) has a table and a slot per
row for each group in the buffers, and each group's backend is prepared in the capture.

`CudaGraphCapture` is the one place that touches CUDA; the tests give the runner a
stand-in that re-runs the captured function at replay, which checks on CPU that a
replay depends on nothing but the buffers.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.device import uses_pinned_memory
from scheduler import ScheduledRequest

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


class DecodeBuffers:
    """The persistent inputs every captured graph reads, sized for the largest batch, and
    their host twins. A step writes rows 0..n-1 and pads rows n..size-1 on the host, then
    two copies move them: `longs` (token ids, positions, slots) and `ints` (context lengths,
    then the block tables), so a replay costs two copies, not one per field. A hybrid
    model's `groups` KV cache groups each have their own slots and tables."""

    def __init__(
        self, max_size: int, max_blocks: int, device: torch.device, groups: int = 1
    ) -> None:
        self.max_size, self.max_blocks, self.groups = max_size, max_blocks, groups
        pinned = uses_pinned_memory(device)
        # Rows: token ids, positions, each group's slots (-1 on padding rows: nothing written).
        self._host_longs = torch.zeros(2 + groups, max_size, dtype=torch.long, pin_memory=pinned)
        # Context lengths (0 on padding rows: nothing read), then [max_size, groups,
        # max_blocks] block tables, so the lengths and a step's first rows of tables (of
        # every group) are one prefix.
        self._host_ints = torch.zeros(
            max_size * (1 + groups * max_blocks), dtype=torch.int32, pin_memory=pinned
        )
        self._host_longs[2:] = -1
        # Per group and row: the block table (the KV manager's tuple, replaced when blocks
        # are added, never mutated) its row of the host tables holds, so a step writes only
        # what changed: converting every table's ints would cost more than the rest of the
        # step's host work (~190 us for 64 x 125 blocks here).
        self._rows: list[list[tuple[int, ...]]] = [[()] * max_size for _ in range(groups)]
        self.longs = self._host_longs.to(device)
        self.ints = self._host_ints.to(device)
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)

    @property
    def input_ids(self) -> torch.Tensor:
        return self.longs[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.longs[1]

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.longs[2]  # group 0's; group g's is longs[2 + g]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.ints[: self.max_size]

    @property
    def block_tables(self) -> torch.Tensor:
        return self.group_tables(0)

    def group_tables(self, group: int) -> torch.Tensor:
        """KV cache group `group`'s [max_size, max_blocks] tables (rows strided by all the
        groups' tables)."""
        tables = self.ints[self.max_size :].view(self.max_size, self.groups, self.max_blocks)
        return tables[:, group]

    def metadata(self, size: int, max_seq_len: int, block_size: int) -> AttentionMetadata:
        """The metadata a graph of `size` decodes is captured with: views of the buffers,
        and host fields that hold for any step it replays (one token each, contexts up to
        max_seq_len); a hybrid model's other groups' in `group_metas`."""
        meta = self._group_metadata(0, size, max_seq_len, block_size)
        meta.group_metas = tuple(
            self._group_metadata(g, size, max_seq_len, block_size) for g in range(1, self.groups)
        )
        return meta

    def _group_metadata(
        self, group: int, size: int, max_seq_len: int, block_size: int
    ) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.longs[2 + group, :size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.group_tables(group)[:size],
            # Backends that plan from the host table do not capture (`cuda_graphs`).
            block_tables_host=np.zeros((size, self.max_blocks), dtype=np.int64),
            positions=self.positions[:size],
            query_lens=[1] * size,
            seq_lens_list=[max_seq_len] * size,
            query_start_loc_list=list(range(size + 1)),
            max_query_len=1,
            max_seq_len=max_seq_len,
            block_size=block_size,
            num_decodes=size,
        )

    def load(self, scheduled: list[ScheduledRequest], size: int, block_size: int) -> None:
        """Write a step of n one-token requests into rows 0..n-1, pad rows n..size-1, and
        copy both buffers to the device. The copies wait for the device (not non_blocking):
        a step that samples nothing (a prompt's one-token chunk) syncs nowhere else, and
        the next step must not rewrite a host twin while its copy is still queued."""
        n = len(scheduled)
        longs = self._host_longs.numpy()
        ints = self._host_ints.numpy()
        seq_lens = ints[: self.max_size]
        all_tables = ints[self.max_size :].reshape(self.max_size, self.groups, self.max_blocks)
        positions = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, n)
        for group, rows in enumerate(self._rows):
            tables = all_tables[:, group]
            for row, s in enumerate(scheduled):
                table = s.group_block_ids[group - 1] if group else s.block_ids
                held = rows[row]
                if held is table:
                    continue
                # A table that extends what the row holds (the same request, grown) needs
                # only its tail. Compared by value, not by request and block count: a
                # request preempted and admitted again has a new table of the same length
                # (~0.6 us for 125 blocks, paid only in steps where a table changed); a
                # sliding-window group's table also changes where blocks left the window.
                start = len(held) if table[: len(held)] == held else 0
                tables[row, start : len(table)] = table[start:]
                rows[row] = table
            longs[2 + group, :n] = tables[np.arange(n), positions // block_size] * block_size + (
                positions % block_size
            )
        longs[0, :n] = [s.token_ids[0] for s in scheduled]
        longs[1, :n] = positions
        seq_lens[:n] = positions + 1
        # The previous step's rows must not be replayed as real requests.
        longs[0:2, n:size] = 0
        longs[2:, n:size] = -1
        seq_lens[n:size] = 0
        self.longs.copy_(self._host_longs)
        # the lengths and `size` rows of every group's tables
        used = self.max_size + size * self.groups * self.max_blocks
        self.ints[:used].copy_(self._host_ints[:used])


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
        groups = len(model.attn_backends)  # KV cache groups: more than one in a hybrid model
        self.buffers = DecodeBuffers(self.sizes[-1], max_blocks, device, groups)
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

        def forward() -> torch.Tensor:
            # Planning a decode-only step is host integers only (`cuda_graphs`), so it may
            # sit inside the capture; a stand-in capture that re-runs this needs it. Each
            # KV cache group's backend plans over its group's view (`meta.for_group`).
            self.model.prepare_attention(meta)
            return self.model(input_ids, meta.positions, self.kv_caches, meta)

        return forward

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def graph_size(self, scheduled: list[ScheduledRequest]) -> int | None:
        """The captured size this step replays at, or None: run it eagerly (a step with a
        prefill, a batch above the largest size, a table longer than the buffers')."""
        max_blocks = self.buffers.max_blocks
        if any(len(s.token_ids) != 1 or len(s.block_ids) > max_blocks
               or any(len(t) > max_blocks for t in s.group_block_ids)
               for s in scheduled):  # fmt: skip
            return None
        index = bisect.bisect_left(self.sizes, len(scheduled))
        if index == len(self.sizes) or self.sizes[index] not in self._graphs:
            return None
        return self.sizes[index]

    def run(self, scheduled: list[ScheduledRequest]) -> torch.Tensor | None:
        """The step's hidden states ``[n, H]`` from a replay, or None where no graph fits.
        The result is a view of the graph's output: read it before the next step."""
        size = self.graph_size(scheduled)
        if size is None:
            return None
        self.buffers.load(scheduled, size, self.block_size)
        replay, hidden = self._graphs[size]
        replay()
        return hidden[: len(scheduled)]
