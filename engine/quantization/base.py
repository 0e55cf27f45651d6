"""What a weight format ("quantization method") provides, and the registry of them.

A `Linear` loads its checkpoint weight as ``[out, in]`` into its ``weight`` parameter and
hands everything format-specific to its method: the dtype that weight loads in, what a
loaded tensor (dense or GGUF blocks) becomes, the layout `pack` turns it into, the
multiply, and the arguments of its native decode stack projection. A method keeps its
format's own state (scales, blocks, the kernel module it calls); the `Linear` keeps
``weight`` and ``bias``, which the model's loader writes into.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from engine.gguf_weights import GGUFTensor
from engine.kernels import bf16_cpu_kernels
from engine.registry import QUANTIZATION_METHODS


def weight_rows(target: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    """Rows ``(first, count)`` of a parameter (a fused projection's part), or all of it."""
    return target if rows is None else target.narrow(0, rows[0], rows[1])


def check_shape(tensor: torch.Tensor | GGUFTensor, dest: torch.Tensor) -> None:
    """A checkpoint tensor must fill its destination exactly."""
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(f"shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")


def kernel_for(weight: torch.Tensor) -> ModuleType | None:
    """The skinny GEMM kernel for this ``[out, in]`` weight, decided once when it is packed:
    bf16 (or int8, whose activations are bf16) on a CPU with the kernels, ``in`` a multiple
    of 32; else None, and torch multiplies it."""
    if weight.shape[1] % 32:
        return None
    dtype = torch.bfloat16 if weight.dtype in (torch.int8, torch.uint8) else weight.dtype
    return bf16_cpu_kernels(dtype, weight.device)


class QuantizationMethod:
    """One weight format of a `Linear`. Subclasses register under the name
    ``--quantization`` and `Linear` use (`register`)."""

    name: ClassVar[str | None]
    # Packed from a float checkpoint at `pack`, so `--quantization` may ask for it.
    from_float: ClassVar[bool] = False

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.kernel: ModuleType | None = None  # set by `pack`

    @property
    def load_dtype(self) -> torch.dtype:
        """The dtype of the ``[out, in]`` weight the checkpoint loads into."""
        return self.dtype

    def load(
        self, weight: nn.Parameter, tensor: torch.Tensor | GGUFTensor, rows: tuple[int, int] | None
    ) -> None:
        """Copy ``tensor`` into ``weight``'s rows ``rows`` (first, count; None: all), GGUF
        blocks dequantized exactly."""
        dest = weight_rows(weight, rows)
        check_shape(tensor, dest)
        if isinstance(tensor, GGUFTensor):
            tensor = tensor.dequantize(torch.float32)
        dest.copy_(tensor.to(device=dest.device, dtype=dest.dtype))

    def pack(self, weight: nn.Parameter) -> nn.Parameter | None:
        """The loaded weight laid out for this format's multiply; what `Linear.weight`
        becomes (None where the method keeps the weights itself)."""
        raise NotImplementedError

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ W.T (+ bias)`` on the packed weight."""
        raise NotImplementedError

    @property
    def kernel_max_rows(self) -> int:
        """The most rows `forward` sends through the kernel (0: it has none)."""
        raise NotImplementedError

    def use_kernel_at_every_size(self) -> bool:
        """After `pack`, for batch invariance: send every call, whatever its row count,
        through the one kernel whose result for a row does not depend on the call's other
        rows. False where the method has none (torch's matmul rounds a call of 1 row and of
        2 differently)."""
        return False

    def formats(self) -> list[str]:
        """What its weights run as, for the start-up line (one entry per fused part where
        the parts differ)."""
        return [str(self.name)]

    def stack_projection(
        self, ops: ModuleType, weight: torch.Tensor | None, bias: torch.Tensor | None
    ) -> Any:
        """This projection as the native decode stack takes it: ``ops.Projection(weight,
        scales, mins, bias, ggml blocks, ggml type ids)``."""
        return ops.Projection(weight, None, None, bias, [], [])


# engine/registry.py's, which the config reads --quantization's choices from.
METHODS = QUANTIZATION_METHODS
Method = TypeVar("Method", bound=type[QuantizationMethod])


def register(name: str | None) -> Callable[[Method], Method]:
    """Class decorator: the method serving ``Linear(..., quantization=name)``."""

    def add(method: Method) -> Method:
        method.name = name
        return METHODS.add(name, method)

    return add


def method_for(quantization: str | None) -> type[QuantizationMethod]:
    return METHODS[quantization]  # ValueError naming the choices
