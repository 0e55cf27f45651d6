"""The CPU paged backend: decodes through the paged decode kernel, prefills through SDPA.

For bf16 on CPUs with AVX512-BF16, and float32 on a GGUF's blocks (AVX2; see
`engine.kernels.layer_kernels`). Each decode
reads its blocks straight from the cache in one kernel call per layer for the whole
step: no gathered copy, no padded mask, no cascade planning. Measured per layer call
against the SDPA backend (9 query / 3 KV heads, head_dim 64, `python -m
bench.attention_bench --backends sdpa,cpu-paged`): 6.1x at 1 request of 300 tokens, 4.0x
at 4 of up to 600, 4.3x at 32 of up to 600 (where SDPA's cascade read shared prefixes
once, the kernel still wins; see bench/attention.md). Multi-token queries (prefills,
chunks) keep the SDPA backend's per-request causal call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.kv_cache import is_quantized
from engine.attention.metadata import AttentionMetadata
from engine.attention.sdpa import Prefill, plan_prefills, sdpa_prefill
from engine.kernels import ggml_kernels


@dataclass
class _Decodes:
    rows: slice | torch.Tensor  # the decode tokens' rows of the flat batch
    block_tables: torch.Tensor  # [D, max_blocks] int32
    seq_lens: torch.Tensor  # [D] int32


class CpuPagedBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int) -> None:
        super().__init__(num_heads, num_kv_heads)
        self._kernels = ggml_kernels()  # the paged decode kernel of both builds
        if self._kernels is None:
            raise ValueError("the cpu-paged attention backend needs AVX2 (see the log)")
        self._decodes: _Decodes | None = None
        self._prefills: list[Prefill] = []
        self._prepared = False

    def prepare(self, meta: AttentionMetadata) -> None:
        self._decodes = _plan_decodes(meta)
        self._prefills = plan_prefills(meta)
        self._prepared = True

    def decode_only_tables(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a prepared step whose every query is a decode (row r is request r): the
        block tables and context lengths the decode kernel reads; else None."""
        if not self._prepared:
            raise RuntimeError("CpuPagedBackend.prepare(meta) must run before the step's layers")
        if self._decodes is None or self._prefills:
            return None
        return self._decodes.block_tables, self._decodes.seq_lens

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if not self._prepared:
            raise RuntimeError("CpuPagedBackend.prepare(meta) must run before the step's layers")
        decodes = self._decodes
        if self.decode_only_tables() is not None:  # no scatter
            return self._attend_decodes(q, k_cache, v_cache, decodes, scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if decodes is not None:
            out[decodes.rows] = self._attend_decodes(
                q[decodes.rows], k_cache, v_cache, decodes, scale
            )
        for prefill in self._prefills:
            out[prefill.tokens] = sdpa_prefill(q[prefill.tokens], k_cache, v_cache, prefill, scale)
        return out

    def _attend_decodes(
        self, q: torch.Tensor, k_cache, v_cache, decodes: _Decodes, scale: float
    ) -> torch.Tensor:
        if is_quantized(k_cache) and q.dtype != torch.float32:
            # int8 rows are read by the float32 kernel (the bf16 one reads bf16 caches).
            out = self._kernels.paged_decode_attention(
                q.float().contiguous(), k_cache, v_cache, decodes.block_tables,
                decodes.seq_lens, scale,
            )  # fmt: skip
            return out.to(q.dtype)
        return self._kernels.paged_decode_attention(
            q.contiguous(), k_cache, v_cache, decodes.block_tables, decodes.seq_lens, scale
        )


def _plan_decodes(meta: AttentionMetadata) -> _Decodes | None:
    """The step's single-token queries, as rows of the flat batch and their tables."""
    if meta.num_decodes == 0:
        return None
    if meta.num_decodes == meta.num_reqs:  # all decodes: row r is request r
        return _Decodes(slice(0, meta.num_reqs), meta.block_tables, meta.seq_lens)
    reqs = [r for r, q_len in enumerate(meta.query_lens) if q_len == 1]
    starts = meta.query_start_loc_list
    device = meta.block_tables.device
    index = torch.tensor(reqs, dtype=torch.long, device=device)
    rows = torch.tensor([starts[r] for r in reqs], dtype=torch.long, device=device)
    return _Decodes(
        rows,
        meta.block_tables.index_select(0, index).contiguous(),
        meta.seq_lens.index_select(0, index).contiguous(),
    )
