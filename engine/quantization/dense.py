"""Float weights (float32, bf16, float16), laid out after loading for the fastest multiply here
(measured with `python -m bench.dtype_step`; the kernel's own figures are in
`engine/kernels/csrc/skinny_gemm.cpp`):

* float32 on CPU: W's memory becomes ``[in, out]`` (a column-major ``[out, in]`` view).
  torch multiplies 8-32 rows 1.3-2x faster that way and equally fast at 1 and 512 rows.
* bfloat16 on a CPU with AVX512-BF16: W stays ``[out, in]``, which torch multiplies
  0.8-0.94x the time of ``[in, out]`` in bf16, and a decode step of up to
  `SKINNY_MAX_ROWS` rows goes through the skinny GEMM kernel, which streams the weights
  at close to memory bandwidth (1.4-1.9x torch's matmul at 1-4 rows).
* anything else (CUDA): ``F.linear`` on ``[out, in]``, which cuBLAS handles either way.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.quantization.base import QuantizationMethod, kernel_for, register

# Up to this many rows the skinny kernel beats torch's bf16 matmul on the default model's
# shapes (1.7x at 1 row, 1.4-1.9x at 4, 1.0-1.3x at 8, 0.8-1.2x at 16-32).
SKINNY_MAX_ROWS = 8


def project(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernel: ModuleType | None = None,
    max_rows: int = SKINNY_MAX_ROWS,
) -> torch.Tensor:
    """``x @ W.T (+ bias)``: through ``kernel`` (from `kernel_for`) for an x of at most
    ``max_rows`` rows (decode-sized), else torch's matmul."""
    if kernel is not None and x.shape[0] <= max_rows:
        return kernel.skinny_linear(x.contiguous(), weight, None, bias)
    return F.linear(x, weight, bias)


@register(None)
class DenseMethod(QuantizationMethod):
    skinny_rows = SKINNY_MAX_ROWS  # rows through the skinny kernel (any: batch-invariant)

    def pack(self, weight: nn.Parameter) -> nn.Parameter:
        w = weight.data
        if w.device.type == "cpu" and w.dtype == torch.float32:
            weight.data = w.t().contiguous().t()
        self.kernel = kernel_for(weight)
        self.skinny_rows = SKINNY_MAX_ROWS
        return weight

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return project(x, weight, bias, self.kernel, self.skinny_rows)

    def use_kernel_at_every_size(self) -> bool:
        """bf16 weights with the skinny kernel: every call through it (its tiles of 1-4
        rows add a row's products in one order, so a row's result is the same in any call)."""
        if self.kernel is None:
            return False
        self.skinny_rows = sys.maxsize
        return True

    @property
    def kernel_max_rows(self) -> int:
        return 0 if self.kernel is None else self.skinny_rows

    def formats(self) -> list[str]:
        return [str(self.dtype).removeprefix("torch.")]
