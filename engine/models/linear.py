"""A projection ``y = x @ W.T + b``, laid out after loading for the fastest multiply here.

Checkpoints store W as ``[out, in]`` and `Linear` loads it that way; `pack` then picks
the layout and kernel by device, dtype and quantization (measured with `python -m
bench.dtype_step`; the kernels' own figures are in `engine/kernels/csrc/skinny_gemm.cpp`):

* float32 on CPU: W's memory becomes ``[in, out]`` (a column-major ``[out, in]`` view).
  torch multiplies 8-32 rows 1.3-2x faster that way and equally fast at 1 and 512 rows.
* bfloat16 on a CPU with AVX512-BF16: W stays ``[out, in]``, which torch multiplies
  0.8-0.94x the time of ``[in, out]`` in bf16, and a decode step of up to
  `SKINNY_MAX_ROWS` rows goes through the skinny GEMM kernel, which streams the weights
  at close to memory bandwidth (1.4-1.9x torch's matmul at 1-4 rows).
* ``quantization="int8"`` (that CPU only): W becomes int8 with one float32 scale per
  `INT8_GROUP` weights of a row, symmetric (``W ~= q * scale``, rounded to bf16 in the
  kernel). Half the bytes of bf16 again; more rows than `INT8_KERNEL_MAX_ROWS` (prefill)
  multiply a bf16 copy dequantized for that call.
* anything else (CUDA): ``F.linear`` on ``[out, in]``, which cuBLAS handles either way.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import bf16_cpu_kernels

# Up to this many rows the skinny kernel beats torch's bf16 matmul on the default model's
# shapes (1.7x at 1 row, 1.4-1.9x at 4, 1.0-1.3x at 8, 0.8-1.2x at 16-32).
SKINNY_MAX_ROWS = 8
# int8 weights go through the kernel up to this many rows: at 16-32 rows it is 0.85-0.95x
# torch's bf16 matmul but 2x faster than dequantizing the weight for every call, which
# only pays for prefill-sized calls.
INT8_KERNEL_MAX_ROWS = 64
# Weights per int8 scale. 64 keeps the default model's perplexity within +0.6% of float32;
# one scale per row (per channel) cost +1.2%, over the 1% quality gate.
INT8_GROUP = 64


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


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


def kernel_for(weight: torch.Tensor) -> ModuleType | None:
    """The skinny GEMM kernel for this ``[out, in]`` weight, decided once when it is packed:
    bf16 (or int8, whose activations are bf16) on a CPU with the kernels, ``in`` a multiple
    of 32; else None, and torch multiplies it."""
    if weight.shape[1] % 32:
        return None
    dtype = torch.bfloat16 if weight.dtype == torch.int8 else weight.dtype
    return bf16_cpu_kernels(dtype, weight.device)


def project(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    kernel: ModuleType | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)``: through ``kernel`` (from `kernel_for`) for a decode-sized x,
    else torch's matmul (on the dequantized weight when ``scales`` says it is int8)."""
    max_rows = SKINNY_MAX_ROWS if scales is None else INT8_KERNEL_MAX_ROWS
    if kernel is not None and x.shape[0] <= max_rows:
        return kernel.skinny_linear(x.contiguous(), weight, scales, bias)
    if scales is not None:
        weight = dequantize_int8(weight, scales, x.dtype)
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device
    ) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype, device=device)
        self.bias = _param(out_features, dtype=dtype, device=device) if bias else None
        self.scales: torch.Tensor | None = None  # int8 only: [out, in / INT8_GROUP]
        self.kernel: ModuleType | None = None  # set by `pack`

    def pack(self, quantization: str | None = None) -> None:
        """Lay the loaded weight out for this device and dtype (see the module docstring)."""
        w = self.weight.data
        if quantization == "int8":
            if w.shape[1] % INT8_GROUP:
                raise ValueError(
                    f"int8 quantization needs in_features divisible by {INT8_GROUP}, "
                    f"got {w.shape[1]}"
                )
            q, self.scales = quantize_int8(w)
            self.weight = nn.Parameter(q, requires_grad=False)
        elif quantization is not None:
            raise ValueError(f"unknown quantization {quantization!r}")
        elif w.device.type == "cpu" and w.dtype == torch.float32:
            self.weight.data = w.t().contiguous().t()
        self.kernel = kernel_for(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.scales, self.kernel)
