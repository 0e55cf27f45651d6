"""``quantization="int8"`` (a CPU with AVX512-BF16 only): W becomes int8 with one float32 scale
per `INT8_GROUP` weights of a row, symmetric (``W ~= q * scale``, rounded to bf16 in the
kernel). Half the bytes of bf16 again; more rows than `INT8_KERNEL_MAX_ROWS` (prefill)
multiply a bf16 copy dequantized for that call. The kernel is the skinny GEMM's
(`skinny_linear` with scales, `engine/kernels/csrc/skinny_gemm.cpp`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.quantization.base import QuantizationMethod, kernel_for, register

# int8 weights go through the kernel up to this many rows: at 16-32 rows it is 0.85-0.95x
# torch's bf16 matmul but 2x faster than dequantizing the weight for every call, which
# only pays for prefill-sized calls.
INT8_KERNEL_MAX_ROWS = 64
# Weights per int8 scale. 64 keeps the default model's perplexity within +0.6% of float32;
# one scale per row (per channel) cost +1.2%, over the 1% quality gate.
INT8_GROUP = 64


def quantize_int8(
    weight: torch.Tensor, group: int = INT8_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (int8 ``[N, K]``, float32 scales ``[N, K / group]``), symmetric per group."""
    n, k = weight.shape
    groups = weight.float().view(n, k // group, group)
    scales = groups.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    q = torch.round(groups / scales[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.view(n, k), scales.contiguous()


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_int8`, rounded to ``dtype`` as the kernel rounds it."""
    n, k = q.shape
    groups = q.float().view(n, scales.shape[1], -1) * scales[..., None]
    return groups.view(n, k).to(dtype)


def project_int8(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    kernel: ModuleType | None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for int8 weights: the kernel for a decode-sized x, else torch's
    matmul on the weight dequantized for this call."""
    if kernel is not None and x.shape[0] <= INT8_KERNEL_MAX_ROWS:
        return kernel.skinny_linear(x.contiguous(), q, scales, bias)
    return F.linear(x, dequantize_int8(q, scales, x.dtype), bias)


@register("int8")
class Int8Method(QuantizationMethod):
    from_float = True

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, dtype)
        self.scales: torch.Tensor | None = None  # [out, in / INT8_GROUP], set by `pack`

    def pack(self, weight: nn.Parameter) -> nn.Parameter:
        if weight.shape[1] % INT8_GROUP:
            raise ValueError(
                f"int8 quantization needs in_features divisible by {INT8_GROUP}, "
                f"got {weight.shape[1]}"
            )
        q, self.scales = quantize_int8(weight.data)
        self.kernel = kernel_for(q)
        return nn.Parameter(q, requires_grad=False)

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return project_int8(x, weight, self.scales, bias, self.kernel)

    @property
    def kernel_max_rows(self) -> int:
        return 0 if self.kernel is None else INT8_KERNEL_MAX_ROWS

    def stack_projection(
        self, ops: ModuleType, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> Any:
        return ops.Projection(weight, self.scales, None, bias, [], [])
