"""``quantization="gguf"`` (CPU, float32 or bf16 activations): a GGUF's weights stay in their
ggml blocks, as the file holds them (`load` keeps each `GGUFTensor` whose format
`ggml_linear` multiplies; a fused projection may mix formats, as Q4_K_M files do).
`ggml_linear` (`engine/kernels/csrc/ggml_quants.cpp`) multiplies them on int8-quantized
activations, as llama.cpp computes (F16 and BF16 weights: on float32 ones; IQ2_XXS, IQ2_XS,
IQ2_S, IQ3_XXS and IQ3_S in the file's layout). Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q6_K, IQ4_NL, IQ4_XS and MXFP4 are regrouped 8 rows at a time
at load (a layout whose kernel is 512 bits wide on AVX-512); for
Q4_0, Q5_0, Q8_0, Q4_K and Q6_K that kernel also serves prefill, while bf16 calls of more
than `GGML_DOT_MAX_ROWS` rows on other formats dequantize the blocks to bf16 for the call
and take torch's GEMM. A projection with any part in another format is
dequantized whole, and served as float weights are (`DenseMethod`).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.gguf_weights import HALF_TYPES, GGUFTensor
from engine.kernels import ggml_kernels
from engine.quantization.base import check_shape, register, weight_rows
from engine.quantization.dense import DenseMethod

GGUF = "gguf"  # keep a GGUF's own blocks
# GGUF blocks in their file's layout with bf16 activations: calls of more rows than this
# (prefill, large batches) dequantize the weight to bf16 for the call and take torch's bf16
# GEMM, where those int8 dot products are bound by arithmetic. Regrouped blocks (Q4_0,
# Q4_K, Q6_K) take their int8 kernel at any size: at 512 rows it is 1.0x (Q6_K) to 1.6x
# (Q4_0, Q4_K) faster than dequantizing and the GEMM (`python -m bench.ggml_kernels
# --prefill`, Zen 5).
GGML_DOT_MAX_ROWS = 32
ANY_ROWS = sys.maxsize
# The formats whose regrouped kernel takes bf16 calls of any size. Q4_1 and Q5_1 (the
# default model's Q4_1 file) are regrouped for decode and verify rows, but their prefill
# stays on dequantized bf16 weights: there int8 activations cost the default model ~1.3-1.8%
# perplexity against -0.06% (tests/engine/test_quality_gate.py), and on an AVX512-BF16 Xeon the
# bf16 GEMM was 2.8x faster at 512 rows (`bench.ggml_kernels --prefill`, 2026-11-28).
INT8_AT_ANY_SIZE = frozenset({"Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K"})
# The formats that can be served from the mapped file's own pages, never copied: their kernel
# reads the file's layout 8 rows at a time, regrouping each block column in registers, with
# the same integer sums and float operations as on a regrouped copy (the same bits;
# ggml_table4.cpp's file_column_mx). MXFP4 is gpt-oss' experts, most of its file. It costs CPU
# time (one thread, a 1B layer: 1.93x the regrouped copy's at 1 row, 1.72x at 4, 1.24x at 32;
# `python -m bench.ggml_kernels --cpu-time --types MXFP4,MXFP4-file`, Zen 3), so it is taken
# only where the copy would not comfortably fit (`choose_mapped`): there the kernel pages the
# file in and out as llama.cpp's mapped files are, instead of the whole of it sitting in
# anonymous memory that nothing can evict.
FROM_FILE = frozenset({"MXFP4"})
# A file of more than this share of MemAvailable at load serves `FROM_FILE` from its pages:
# the copy is faster and is what llama-server holds too (it repacks into anonymous memory), so
# it is kept wherever it fits beside the KV cache and the rest with a quarter to spare.
COPY_SHARE = 0.75
MAPPED_ENV = "PAGEDSERVE_GGUF_MAPPED"  # auto (the default: COPY_SHARE), always, never
_mapped: frozenset[str] = frozenset()  # the load in progress's choice (`choose_mapped`)


@register(GGUF)
class GGUFMethod(DenseMethod):
    """Until `pack` finds every row in blocks the kernels multiply, this is the dense method
    with the rows it dequantized; after, either that or the blocks alone."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, dtype)
        self.blocks: dict[int, GGUFTensor] = {}  # kept by `load`, by first row
        self.dense_rows = 0  # rows that arrived in a format kept dense
        self.dequantized: set[str] = set()  # the block types it holds dense
        # after `pack`: the kernel's (blocks, type ids) and each part's (type, rows)
        self.ggml: tuple[list[torch.Tensor], list[int]] | None = None
        self.parts: list[tuple[str, int]] = []
        self.max_rows = GGML_DOT_MAX_ROWS  # bf16 rows through `ggml_linear`
        # every part F16/BF16 (a float file's): float32 calls of more than `max_rows` rows too
        # take the weight made float for the call and torch's GEMM (the float kernel is a pass
        # over memory at decode; at prefill its tiles of 4 rows are FMA-bound, where torch's
        # blocked GEMM is not: not yet measured against it)
        self.half_parts = False

    def load(
        self, weight: nn.Parameter, tensor: torch.Tensor | GGUFTensor, rows: tuple[int, int] | None
    ) -> None:
        if isinstance(tensor, GGUFTensor) and tensor.native:
            check_shape(tensor, weight_rows(weight, rows))
            self.blocks[0 if rows is None else rows[0]] = tensor
            return
        super().load(weight, tensor, rows)
        if isinstance(tensor, GGUFTensor):
            self.dequantized.add(tensor.type.name)
        self.dense_rows += weight_rows(weight, rows).shape[0]

    def pack(self, weight: nn.Parameter) -> nn.Parameter | None:
        if self.blocks and not self.dense_rows:
            self._keep_blocks()
            return None
        for row, part in self.blocks.items():  # a mix: all dense
            self.dequantized.add(part.type.name)
            weight.data.narrow(0, row, part.shape[0]).copy_(part.dequantize(weight.dtype))
        self.blocks.clear()
        return super().pack(weight)

    def _keep_blocks(self) -> None:
        parts = [self.blocks[row] for row in sorted(self.blocks)]
        # Each part in the layout its kernel reads fastest (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
        # Q4_K, Q6_K: regrouped by 8 rows), or the file's own (`FROM_FILE`).
        packed = [_layout(p) for p in parts]
        regrouped = [qtype != int(p.type) for p, (_, qtype) in zip(parts, packed, strict=True)]
        for part, copied in zip(parts, regrouped, strict=True):
            if copied:  # a repacked copy now serves it
                part.release()
        if all(regrouped) and all(p.type.name in INT8_AT_ANY_SIZE for p in parts):
            self.max_rows = ANY_ROWS
        self.half_parts = all(p.type in HALF_TYPES for p in parts)
        self.ggml = ([blocks for blocks, _ in packed], [qtype for _, qtype in packed])
        self.parts = [(p.type.name, p.shape[0]) for p in parts]
        self.blocks.clear()

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if self.ggml is None:
            return super().forward(x, weight, bias)
        if x.shape[0] > self.max_rows and (x.dtype == torch.bfloat16 or self.half_parts):
            return F.linear(x, self.dense_weight(x.dtype), bias)
        y = ggml_kernels().ggml_linear(x, *self.ggml)
        return y if bias is None else y + bias

    def use_kernel_at_every_size(self) -> bool:
        """Blocks kept: bf16 calls of every size take the int8 dot products too (whose tiles
        add a row's blocks in one order at every tile height, ggml_quants.cpp's rows_dot)."""
        if self.ggml is None:
            return False
        self.max_rows = ANY_ROWS
        return True

    @property
    def kernel_max_rows(self) -> int:
        """GGUF blocks go through their kernel at any size up to `max_rows`."""
        return super().kernel_max_rows if self.ggml is None else self.max_rows

    def formats(self) -> list[str]:
        """GGUF block types (one per fused part), else the dtype naming the GGUF types
        dequantized into it (the fallback for a format the kernels do not multiply)."""
        if self.ggml is not None:
            return [name for name, _ in self.parts]
        if self.dequantized:
            return [f"{super().formats()[0]} (dequantized {'+'.join(sorted(self.dequantized))})"]
        return [GGUF]

    def stack_projection(
        self, ops: ModuleType, weight: torch.Tensor | None, bias: torch.Tensor | None
    ) -> Any:
        if self.ggml is None:
            return super().stack_projection(ops, weight, bias)
        return ops.Projection(None, None, None, bias, *self.ggml)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The ``[out, in]`` weight of its blocks in ``dtype`` (float32 or bf16), made for
        one call: exact, then rounded once."""
        kernels = ggml_kernels()
        device = self.ggml[0][0].device  # the blocks' (host) memory
        weight = torch.empty(self.out_features, self.in_features, dtype=dtype, device=device)
        row = 0
        for blocks, qtype, (_, rows) in zip(*self.ggml, self.parts, strict=True):
            part = weight.narrow(0, row, rows)
            kernels.ggml_dequantize(blocks, qtype, self.in_features, None, part)
            row += rows
        return weight


def choose_mapped(file_bytes: int, available: int) -> frozenset[str]:
    """Before a GGUF's weights load: the types it serves from the mapped file (`FROM_FILE`
    where the file is more than `COPY_SHARE` of the ``available`` memory, or as
    $PAGEDSERVE_GGUF_MAPPED says: ``always``, ``never``), kept for that load's `_layout`."""
    global _mapped
    mode = os.environ.get(MAPPED_ENV, "auto")
    if mode not in ("auto", "always", "never"):
        raise ValueError(f"${MAPPED_ENV} must be auto, always or never, not {mode!r}")
    large = file_bytes > COPY_SHARE * available
    _mapped = FROM_FILE if mode == "always" or (mode == "auto" and large) else frozenset()
    return _mapped


def _layout(part: GGUFTensor) -> tuple[torch.Tensor, int]:
    """A part's (blocks, type) as `ggml_linear` takes them: the file's own where this load
    serves its type from the file (`choose_mapped`), else regrouped where its kernel reads a
    regrouped copy faster."""
    if part.type.name in _mapped:
        return part.blocks, int(part.type)
    return ggml_kernels().ggml_repack(part.blocks, int(part.type), part.shape[1])
