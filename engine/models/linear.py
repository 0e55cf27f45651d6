"""A projection ``y = x @ W.T + b``, laid out after loading for the fastest multiply here.

Checkpoints store W as ``[out, in]`` and `Linear` loads it that way; `pack` then lays it out
for its weight format, the quantization method named by ``quantization``
(`engine/quantization/`: float weights, int8, int4, a GGUF's blocks), which owns the
layout, the multiply and its kernel, with the measured figures behind each choice.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from engine.gguf_weights import GGUFTensor
from engine.quantization import (
    GGUF,
    QUANTIZATIONS,
    check_shape,
    kernel_for,
    method_for,
    weight_rows,
)
from engine.quantization.dense import SKINNY_MAX_ROWS, project
from engine.quantization.gguf import ANY_ROWS, GGML_DOT_MAX_ROWS
from engine.quantization.int4 import (
    INT4_GROUP,
    INT4_KERNEL_MAX_ROWS,
    dequantize_int4,
    quantize_int4,
)
from engine.quantization.int8 import (
    INT8_GROUP,
    INT8_KERNEL_MAX_ROWS,
    dequantize_int8,
    project_int8,
    quantize_int8,
)

__all__ = [
    "ANY_ROWS",
    "GGML_DOT_MAX_ROWS",
    "GGUF",
    "INT4_GROUP",
    "INT4_KERNEL_MAX_ROWS",
    "INT8_GROUP",
    "INT8_KERNEL_MAX_ROWS",
    "QUANTIZATIONS",
    "SKINNY_MAX_ROWS",
    "Linear",
    "check_shape",
    "dequantize_int4",
    "dequantize_int8",
    "kernel_for",
    "project",
    "project_int8",
    "quantize_int4",
    "quantize_int8",
    "weight_rows",
]


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device,
        quantization: str | None = None,
    ) -> None:
        super().__init__()
        self.quantization = quantization
        self.in_features, self.out_features = in_features, out_features
        self.method = method_for(quantization)(in_features, out_features, dtype)
        self.weight = _param(out_features, in_features, dtype=self.method.load_dtype, device=device)
        self.bias = _param(out_features, dtype=dtype, device=device) if bias else None

    def load(self, tensor: torch.Tensor | GGUFTensor, rows: tuple[int, int] | None) -> None:
        """The weight loader: ``tensor`` holds this projection's rows ``rows`` (first,
        count; None: all). GGUF blocks are kept where `quantization` is gguf and the
        kernels multiply their format, else dequantized into the dense weight."""
        self.method.load(self.weight, tensor, rows)

    def pack(self) -> None:
        """Lay the loaded weight out for this device, dtype and quantization (None where
        the method keeps the weights itself, as GGUF blocks)."""
        self.weight = self.method.pack(self.weight)

    def formats(self) -> list[str]:
        """What its weights run as: GGUF block types (one per fused part), else the
        quantization or dtype, naming the GGUF types dequantized into it (the fallback
        for a format the kernels do not multiply)."""
        return self.method.formats()

    @property
    def kernel_max_rows(self) -> int:
        """The most rows `forward` sends through the kernel (0: it has none; GGUF blocks
        go through theirs at any size)."""
        return self.method.kernel_max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.forward(x, self.weight, self.bias)

    def stack_projection(self, ops: ModuleType) -> Any:
        """This projection for the native decode stack (``ops``: the kernels module),
        after `pack`: ``ops.Projection(weight, scales, mins, bias, blocks, types)``."""
        return self.method.stack_projection(ops, self.weight, self.bias)
