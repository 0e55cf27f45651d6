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
* ``quantization="int4"`` (that CPU only): llama.cpp's Q4_1 shape, ``W ~= q * d + m`` with
  q in 0..15 and a float32 d and m per `INT4_GROUP` weights of a row, two q to a byte.
  Up to 4 rows the kernel multiplies without rounding the weights at all; 6 bits a weight,
  a 2.7x smaller read than bf16, which is what a decode step waits on. A model converted
  from a Q4_1 GGUF (the default model) quantizes back to its own blocks: lossless.
* ``quantization="gguf"`` (CPU, float32 or bf16): a GGUF's weights stay in their ggml
  blocks, as the file holds them (`load` keeps each `GGUFTensor` whose format
  `ggml_linear` multiplies; a fused projection may mix formats, as Q4_K_M files do).
  `ggml_linear` multiplies them on int8-quantized activations, as llama.cpp computes.
  Q4_0, Q5_0, Q8_0, Q4_K and Q6_K are regrouped 8 rows at a time at load, a layout whose
  kernel (512 bits wide on AVX-512) also serves prefill; bf16 calls of more than
  `GGML_DOT_MAX_ROWS` rows on other formats dequantize the blocks to bf16 for the call and
  take torch's GEMM. A projection with any part in another format is dequantized whole.
* anything else (CUDA): ``F.linear`` on ``[out, in]``, which cuBLAS handles either way.

int4 layers load their weights in float32, so they are rounded once, by the quantizer
(rounding to bf16 first would move a Q4_1 model's weights off their grid).
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.gguf_weights import GGUFTensor
from engine.kernels import bf16_cpu_kernels, ggml_kernels

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
# Q4_1's block. The kernel's exact path covers up to 4 rows, a dequantized tile up to
# INT4_KERNEL_MAX_ROWS; beyond that (prefill) torch multiplies a dequantized copy.
INT4_GROUP = 32
INT4_KERNEL_MAX_ROWS = 64
# GGUF blocks in their file's layout with bf16 activations: calls of more rows than this
# (prefill, large batches) dequantize the weight to bf16 for the call and take torch's bf16
# GEMM, where those int8 dot products are bound by arithmetic. Regrouped blocks (Q4_0,
# Q4_K, Q6_K) take their int8 kernel at any size: at 512 rows it is 1.0x (Q6_K) to 1.6x
# (Q4_0, Q4_K) faster than dequantizing and the GEMM (`python -m bench.ggml_kernels
# --prefill`, Zen 5).
GGML_DOT_MAX_ROWS = 32
ANY_ROWS = sys.maxsize
QUANTIZATIONS = ("int8", "int4")  # the weight formats `Linear` packs from float weights
GGUF = "gguf"  # keep a GGUF's own blocks


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def weight_rows(target: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    """Rows ``(first, count)`` of a parameter (a fused projection's part), or all of it."""
    return target if rows is None else target.narrow(0, rows[0], rows[1])


def check_shape(tensor: torch.Tensor | GGUFTensor, dest: torch.Tensor) -> None:
    """A checkpoint tensor must fill its destination exactly."""
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(f"shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")


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


def kernel_for(weight: torch.Tensor) -> ModuleType | None:
    """The skinny GEMM kernel for this ``[out, in]`` weight, decided once when it is packed:
    bf16 (or int8, whose activations are bf16) on a CPU with the kernels, ``in`` a multiple
    of 32; else None, and torch multiplies it."""
    if weight.shape[1] % 32:
        return None
    dtype = torch.bfloat16 if weight.dtype in (torch.int8, torch.uint8) else weight.dtype
    return bf16_cpu_kernels(dtype, weight.device)


def kernel_max_rows(scales: torch.Tensor | None, mins: torch.Tensor | None = None) -> int:
    """The most rows of x the kernel multiplies, by weight format (bf16: no scales; int8:
    scales; int4: scales and mins); torch's matmul takes larger calls."""
    if mins is not None:
        return INT4_KERNEL_MAX_ROWS
    return SKINNY_MAX_ROWS if scales is None else INT8_KERNEL_MAX_ROWS


def project(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    kernel: ModuleType | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)``: through ``kernel`` (from `kernel_for`) for a decode-sized x,
    else torch's matmul (on the dequantized weight when ``scales`` says it is int8)."""
    if kernel is not None and x.shape[0] <= kernel_max_rows(scales):
        return kernel.skinny_linear(x.contiguous(), weight, scales, bias)
    if scales is not None:
        weight = dequantize_int8(weight, scales, x.dtype)
    return F.linear(x, weight, bias)


def project_int4(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None,
    kernel: ModuleType,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for int4 blocks: the kernel for a decode-sized x, else torch's
    matmul on the weight dequantized to bf16 for this call."""
    if x.shape[0] <= kernel_max_rows(scales, mins):
        return kernel.int4_linear(x.contiguous(), packed, scales, mins, bias)
    return F.linear(x, kernel.dequantize_int4(packed, scales, mins), bias)


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
        if quantization is not None and quantization not in (*QUANTIZATIONS, GGUF):
            raise ValueError(f"unknown quantization {quantization!r}")
        self.quantization = quantization
        self.in_features, self.out_features = in_features, out_features
        load_dtype = torch.float32 if quantization == "int4" else dtype  # see the docstring
        self.weight = _param(out_features, in_features, dtype=load_dtype, device=device)
        self.bias = _param(out_features, dtype=dtype, device=device) if bias else None
        self.scales: torch.Tensor | None = None  # int8, int4: [out, in / group]
        self.mins: torch.Tensor | None = None  # int4: [out, in / INT4_GROUP]
        self.kernel: ModuleType | None = None  # set by `pack`
        # gguf: the blocks kept by `load`, by first row; after `pack`, in row order
        self.blocks: dict[int, GGUFTensor] = {}
        self.dense_rows = 0  # gguf: rows that arrived in a format kept dense
        self.dequantized: set[str] = set()  # gguf: the block types it holds dense
        # gguf, after `pack`: the kernel's (blocks, type ids) and each part's (type, rows)
        self.ggml: tuple[list[torch.Tensor], list[int]] | None = None
        self.ggml_parts: list[tuple[str, int]] = []
        self.ggml_max_rows = GGML_DOT_MAX_ROWS  # bf16 rows through `ggml_linear`

    def load(self, tensor: torch.Tensor | GGUFTensor, rows: tuple[int, int] | None) -> None:
        """The weight loader: ``tensor`` holds this projection's rows ``rows`` (first,
        count; None: all). GGUF blocks are kept where `quantization` is gguf and the
        kernels multiply their format, else dequantized into the dense weight."""
        dest = weight_rows(self.weight, rows)
        check_shape(tensor, dest)
        if isinstance(tensor, GGUFTensor):
            if self.quantization == GGUF and tensor.native:
                self.blocks[0 if rows is None else rows[0]] = tensor
                return
            self.dequantized.add(tensor.type.name)
            tensor = tensor.dequantize(torch.float32)
        self.dense_rows += dest.shape[0]
        dest.copy_(tensor.to(device=dest.device, dtype=dest.dtype))

    def pack(self) -> None:
        """Lay the loaded weight out for this device, dtype and quantization (see the
        module docstring)."""
        if self.blocks and not self.dense_rows:  # all in kernel formats: keep the blocks
            parts = [self.blocks[row] for row in sorted(self.blocks)]
            # Each part in the layout its kernel reads fastest (Q4_0, Q5_0, Q8_0, Q4_K, Q6_K:
            # regrouped by 8 rows).
            packed = [ggml_kernels().ggml_repack(p.blocks, int(p.type), p.shape[1]) for p in parts]
            regrouped = [qtype != int(p.type) for p, (_, qtype) in zip(parts, packed, strict=True)]
            for part, copied in zip(parts, regrouped, strict=True):
                if copied:  # a repacked copy now serves it
                    part.release()
            if all(regrouped):
                self.ggml_max_rows = ANY_ROWS
            self.ggml = ([blocks for blocks, _ in packed], [qtype for _, qtype in packed])
            self.ggml_parts = [(p.type.name, p.shape[0]) for p in parts]
            self.blocks.clear()
            self.weight = None
            return
        for row, part in self.blocks.items():  # a mix: all dense
            self.dequantized.add(part.type.name)
            self.weight.data.narrow(0, row, part.shape[0]).copy_(part.dequantize(self.weight.dtype))
        self.blocks.clear()
        w = self.weight.data
        quantization = None if self.quantization == GGUF else self.quantization
        if quantization == "int4":
            packed, self.scales, self.mins = quantize_int4(w)
            self.weight = nn.Parameter(packed, requires_grad=False)
        elif quantization == "int8":
            if w.shape[1] % INT8_GROUP:
                raise ValueError(
                    f"int8 quantization needs in_features divisible by {INT8_GROUP}, "
                    f"got {w.shape[1]}"
                )
            q, self.scales = quantize_int8(w)
            self.weight = nn.Parameter(q, requires_grad=False)
        elif w.device.type == "cpu" and w.dtype == torch.float32:
            self.weight.data = w.t().contiguous().t()
        self.kernel = kernel_for(self.weight)

    def formats(self) -> list[str]:
        """What its weights run as: GGUF block types (one per fused part), else the
        quantization or dtype, naming the GGUF types dequantized into it (the fallback
        for a format the kernels do not multiply)."""
        if self.ggml is not None:
            return [name for name, _ in self.ggml_parts]
        dense = str(self.weight.dtype).removeprefix("torch.")
        if self.dequantized and self.quantization == GGUF:
            return [f"{dense} (dequantized {'+'.join(sorted(self.dequantized))})"]
        return [self.quantization or dense]

    @property
    def kernel_max_rows(self) -> int:
        """The most rows `forward` sends through the kernel (0: it has none; GGUF blocks
        go through theirs at any size)."""
        if self.ggml is not None:
            return self.ggml_max_rows
        return 0 if self.kernel is None else kernel_max_rows(self.scales, self.mins)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ggml is not None:
            if x.dtype == torch.bfloat16 and x.shape[0] > self.ggml_max_rows:
                return F.linear(x, self.dense_weight(x.dtype), self.bias)
            y = ggml_kernels().ggml_linear(x, *self.ggml)
            return y if self.bias is None else y + self.bias
        if self.mins is not None:
            return project_int4(x, self.weight, self.scales, self.mins, self.bias, self.kernel)
        return project(x, self.weight, self.bias, self.scales, self.kernel)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The ``[out, in]`` weight of its GGUF blocks in ``dtype`` (float32 or bf16),
        made for one call: exact, then rounded once."""
        kernels = ggml_kernels()
        device = self.ggml[0][0].device  # the blocks' (host) memory
        weight = torch.empty(self.out_features, self.in_features, dtype=dtype, device=device)
        row = 0
        for blocks, qtype, (_, rows) in zip(*self.ggml, self.ggml_parts, strict=True):
            part = weight.narrow(0, row, rows)
            kernels.ggml_dequantize(blocks, qtype, self.in_features, None, part)
            row += rows
        return weight
