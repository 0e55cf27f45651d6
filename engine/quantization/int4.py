"""``quantization="int4"`` (a CPU with AVX512-BF16 only): llama.cpp's Q4_1 shape,
``W ~= q * d + m`` with q in 0..15 and a float32 d and m per `INT4_GROUP` weights of a row,
two q to a byte. Up to 4 rows the kernel (`int4_linear`,
`engine/kernels/csrc/skinny_gemm.cpp`) multiplies without rounding the weights at all; 6
bits a weight, a 2.7x smaller read than bf16, which is what a decode step waits on. A model
converted from a Q4_1 GGUF (the default model) quantizes back to its own blocks: lossless.

int4 layers load their weights in float32, so they are rounded once, by the quantizer
(rounding to bf16 first would move a Q4_1 model's weights off their grid).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.quantization.base import QuantizationMethod, kernel_for, register

# Q4_1's block. The kernel's exact path covers up to 4 rows, a dequantized tile up to
# INT4_KERNEL_MAX_ROWS; beyond that (prefill) torch multiplies a dequantized copy.
INT4_GROUP = 32
INT4_KERNEL_MAX_ROWS = 64


def quantize_int4(
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (uint8 ``[N, K / 2]``, d and m float32 ``[N, K / 32]``) as Q4_1 does:
    per 32 weights m = min, d = (max - min) / 15, q = round((w - m) / d). Each 64 weights
    pack into 32 bytes, byte j holding q[j] (low nibble) and q[32 + j] (high nibble)."""
    n, k = weight.shape
    if k % 64:
        raise ValueError(f"int4 quantization needs in_features divisible by 64, got {k}")
    blocks = weight.float().view(n, k // INT4_GROUP, INT4_GROUP)
    mins = blocks.amin(-1)
    scales = (blocks.amax(-1) - mins) / 15
    step = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((blocks - mins[..., None]) / step[..., None]).clamp_(0, 15).to(torch.uint8)
    q = q.view(n, k // 64, 2, INT4_GROUP)
    packed = q[:, :, 0] | (q[:, :, 1] << 4)
    return packed.reshape(n, k // 2).contiguous(), scales.contiguous(), mins.contiguous()


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The float32 ``[N, K]`` weight of `quantize_int4`'s blocks."""
    n = packed.shape[0]
    chunks = packed.view(n, -1, INT4_GROUP)
    q = torch.stack((chunks & 15, chunks >> 4), dim=2).view(n, -1, INT4_GROUP).float()
    return (q * scales[..., None] + mins[..., None]).view(n, -1)


def project_int4(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None,
    kernel: ModuleType | None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for int4 blocks: the kernel for a decode-sized x, else torch's
    matmul on the weight dequantized for this call (by the kernel where there is one:
    the same values as `dequantize_int4` rounded to bf16, faster)."""
    if kernel is None:
        return F.linear(x, dequantize_int4(packed, scales, mins).to(x.dtype), bias)
    if x.shape[0] <= INT4_KERNEL_MAX_ROWS:
        return kernel.int4_linear(x.contiguous(), packed, scales, mins, bias)
    return F.linear(x, kernel.dequantize_int4(packed, scales, mins), bias)


@register("int4")
class Int4Method(QuantizationMethod):
    from_float = True

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, dtype)
        # d and m, [out, in / INT4_GROUP] each, set by `pack`
        self.scales: torch.Tensor | None = None
        self.mins: torch.Tensor | None = None

    @property
    def load_dtype(self) -> torch.dtype:
        return torch.float32  # see the module docstring

    def pack(self, weight: nn.Parameter) -> nn.Parameter:
        packed, self.scales, self.mins = quantize_int4(weight.data)
        self.kernel = kernel_for(packed)
        return nn.Parameter(packed, requires_grad=False)

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return project_int4(x, weight, self.scales, self.mins, bias, self.kernel)

    @property
    def kernel_max_rows(self) -> int:
        return 0 if self.kernel is None else INT4_KERNEL_MAX_ROWS

    def stack_projection(
        self, ops: ModuleType, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> Any:
        return ops.Projection(weight, self.scales, self.mins, bias, [], [])
