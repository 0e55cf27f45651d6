"""The CPU paged backend: decodes and short multi-token queries through the paged decode
kernel, long prefills through SDPA.

For bf16 on CPUs with AVX512-BF16, and float32 on a GGUF's blocks (AVX2; see
`engine.kernels.layer_kernels`). Each decode
reads its blocks straight from the cache in one kernel call per layer for the whole
step: no gathered copy, no padded mask, no cascade planning. Measured per layer call
against the SDPA backend (9 query / 3 KV heads, head_dim 64, `python -m
bench.attention_bench --backends sdpa,cpu-paged`): 6.1x at 1 request of 300 tokens, 4.0x
at 4 of up to 600, 4.3x at 32 of up to 600 (where SDPA's cascade read shared prefixes
once, the kernel still wins; see bench/attention.md).

A multi-token query of at most `KERNEL_MAX_QUERY` tokens (the new tokens of a request over
its cached prefix, a chunk, a speculative verification) takes the kernel too, one row per
token, each attending up to its own position: its K/V were written before attention, so
causality is each row's context length. That replaces the gather and SDPA call per request
(measured in bench/README.md, "Prefills through the paged kernel"), and a step made only of
such rows runs in the native decode stack as a decode step does. Longer queries keep the
SDPA backend's per-request causal call, whose blocked matmuls reuse each key for many
queries.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.kv_cache import is_quantized
from engine.attention.metadata import AttentionMetadata
from engine.attention.sdpa import Prefill, plan_prefills, sdpa_prefill
from engine.kernels import ggml_kernels

# The longest query the kernel takes as rows (see the module's docstring).
KERNEL_MAX_QUERY = 64


@dataclass
class _Rows:
    rows: slice | torch.Tensor  # the kernel's tokens: rows of the flat batch
    block_tables: torch.Tensor  # [R, max_blocks] int32: each row's request's table
    seq_lens: torch.Tensor  # [R] int32: each row's context (its position + 1)


class CpuPagedBackend(AttentionBackend):
    # the kernel adds each head's sink to the softmax's sum where it merges a row's chunks
    attention_sinks = True

    def __init__(
        self, num_heads: int, num_kv_heads: int, window: int | None = None,
        every_query_as_rows: bool = False, sinks: bool = False,
    ) -> None:  # fmt: skip
        """``every_query_as_rows``: long prefills too go through the kernel, one row per
        token (batch invariance: a token's attention is then computed the same way whether
        it came in a prefill, a chunk, after a cached prefix or as a decode)."""
        super().__init__(num_heads, num_kv_heads, window, sinks)
        self.max_kernel_query = sys.maxsize if every_query_as_rows else KERNEL_MAX_QUERY
        self._kernels = ggml_kernels()  # the paged decode kernel of both builds
        if self._kernels is None:
            raise ValueError("the cpu-paged attention backend needs AVX2 (see the log)")
        self._rows: _Rows | None = None
        self._prefills: list[Prefill] = []
        self._prepared = False

    def prepare(self, meta: AttentionMetadata) -> None:
        self._rows = _plan_rows(meta, self.max_kernel_query)
        self._prefills = plan_prefills(meta, longer_than=self.max_kernel_query, window=self.window)
        self._prepared = True

    def kernel_only_tables(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a prepared step whose every token is a kernel row (row t is token t): the
        block tables and context lengths the decode kernel reads; else None."""
        if not self._prepared:
            raise RuntimeError("CpuPagedBackend.prepare(meta) must run before the step's layers")
        if self._rows is None or self._prefills:
            return None
        return self._rows.block_tables, self._rows.seq_lens

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self._prepared:
            raise RuntimeError("CpuPagedBackend.prepare(meta) must run before the step's layers")
        rows = self._rows
        if self.kernel_only_tables() is not None:  # no scatter
            return self._attend_rows(q, k_cache, v_cache, rows, scale, sinks)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if rows is not None:
            out[rows.rows] = self._attend_rows(q[rows.rows], k_cache, v_cache, rows, scale, sinks)
        for prefill in self._prefills:
            out[prefill.tokens] = sdpa_prefill(
                q[prefill.tokens], k_cache, v_cache, prefill, scale, sinks
            )
        return out

    def _attend_rows(
        self, q: torch.Tensor, k_cache, v_cache, rows: _Rows, scale: float,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        window = self.window or 0
        if is_quantized(k_cache) and q.dtype != torch.float32:
            # int8 rows are read by the float32 kernel (the bf16 one reads bf16 caches).
            out = self._kernels.paged_decode_attention(
                q.float().contiguous(), k_cache, v_cache, rows.block_tables, rows.seq_lens,
                scale, window, sinks,
            )  # fmt: skip
            return out.to(q.dtype)
        return self._kernels.paged_decode_attention(
            q.contiguous(), k_cache, v_cache, rows.block_tables, rows.seq_lens, scale, window,
            sinks,
        )  # fmt: skip


def _plan_rows(meta: AttentionMetadata, max_query: int) -> _Rows | None:
    """The step's tokens the kernel attends: every token of each query of at most
    ``max_query`` tokens, as rows of the flat batch with their tables and lengths."""
    lens = meta.query_lens
    if meta.num_decodes == meta.num_reqs:  # all decodes: row r is request r
        return _Rows(slice(0, meta.num_reqs), meta.block_tables, meta.seq_lens)
    reqs = [r for r, q_len in enumerate(lens) if q_len <= max_query]
    if not reqs:
        return None
    starts = meta.query_start_loc_list
    tokens = [t for r in reqs for t in range(starts[r], starts[r + 1])]
    device = meta.block_tables.device
    owner = torch.tensor([r for r in reqs for _ in range(lens[r])], dtype=torch.long, device=device)
    index = torch.tensor(tokens, dtype=torch.long, device=device)
    seq_lens = (meta.positions.index_select(0, index) + 1).to(torch.int32)
    rows = slice(0, meta.num_tokens) if len(tokens) == meta.num_tokens else index
    return _Rows(rows, meta.block_tables.index_select(0, owner).contiguous(), seq_lens)
