"""The weight formats (`engine/quantization/`) through `Linear`, on any CPU: each method's
torch path (its kernel absent) against a reference dequantized independently here, the
registry, and each method's arguments for the native decode stack.

The int8 and int4 kernels need AVX512-BF16 (tests/engine/test_linear.py checks them there);
these tests build the methods directly, past the config's check for those kernels, so the
wiring of every format runs everywhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf import quants

from engine import gguf_weights
from engine.gguf_weights import GGUFTensor
from engine.kernels import ggml_kernels
from engine.models.linear import GGUF, QUANTIZATIONS, Linear
from engine.quantization import METHODS, DenseMethod, method_for
from tests.engine.gguf_models import random_blocks

ROWS = [1, 8, 65]  # decode sizes and a prefill, either side of every kernel's row limit


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _packed(quantization: str | None, dtype: torch.dtype, in_f: int = 128) -> Linear:
    """A packed `Linear` of 40 rows with a bias, its kernel taken away (torch's path)."""
    linear = Linear(in_f, 40, True, dtype, "cpu", quantization)
    linear.load(_randn(40, in_f, seed=1), None)
    linear.bias.data.copy_(_randn(40, seed=2))
    linear.pack()
    linear.method.kernel = None
    return linear


def _int8_weight(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.repeat_interleave(q.shape[1] // scales.shape[1], dim=1)


def _int4_weight(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_1's layout read byte by byte: each 32 bytes hold 64 weights, byte j the j-th in
    its low nibble and the (32 + j)-th in its high one."""
    n = packed.shape[0]
    chunks = packed.view(n, -1, 32).long()
    q = torch.cat((chunks % 16, chunks // 16), dim=2).view(n, -1).float()
    return q * d.repeat_interleave(32, dim=1) + m.repeat_interleave(32, dim=1)


def test_the_formats_come_from_the_registry():
    assert QUANTIZATIONS == ("int8", "int4")  # --quantization's choices, in this order
    assert set(METHODS) == {None, "int8", "int4", GGUF}
    assert method_for(None) is DenseMethod
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        Linear(64, 8, False, torch.bfloat16, "cpu", "int3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_a_dense_linear_is_torch_s_linear(dtype, rows):
    linear = _packed(None, dtype)
    x = _randn(rows, 128, seed=rows).to(dtype)
    weight = _randn(40, 128, seed=1).to(dtype)
    torch.testing.assert_close(linear(x), F.linear(x, weight, _randn(40, seed=2).to(dtype)))
    assert linear.formats() == [str(dtype).removeprefix("torch.")]


@pytest.mark.parametrize("rows", ROWS)
def test_an_int8_linear_without_its_kernel_multiplies_the_dequantized_weight(rows):
    linear = _packed("int8", torch.bfloat16)
    assert linear.weight.dtype == torch.int8 and linear.kernel_max_rows == 0
    x = _randn(rows, 128, seed=rows).to(torch.bfloat16)
    weight = _int8_weight(linear.weight, linear.method.scales)
    assert torch.equal(linear(x), F.linear(x, weight.to(torch.bfloat16), linear.bias))
    loaded = _randn(40, 128, seed=1).to(torch.bfloat16).float()
    step = linear.method.scales.repeat_interleave(64, dim=1)
    assert torch.all((weight - loaded).abs() <= step / 2 + 1e-6)
    assert linear.formats() == ["int8"]


@pytest.mark.parametrize("rows", ROWS)
def test_an_int4_linear_without_its_kernel_multiplies_the_dequantized_weight(rows):
    linear = _packed("int4", torch.bfloat16)
    assert linear.weight.dtype == torch.uint8 and linear.kernel_max_rows == 0
    x = _randn(rows, 128, seed=rows).to(torch.bfloat16)
    method = linear.method
    weight = _int4_weight(linear.weight, method.scales, method.mins)
    assert torch.equal(linear(x), F.linear(x, weight.to(torch.bfloat16), linear.bias))
    step = method.scales.repeat_interleave(32, dim=1)  # loaded in float32: rounded once
    assert torch.all((weight - _randn(40, 128, seed=1)).abs() <= step / 2 + 1e-5)
    assert linear.formats() == ["int4"]


def _gguf_parts(rng: np.random.Generator) -> list[tuple[T, np.ndarray]]:
    return [
        (qtype, random_blocks(qtype, rows, 256, rng)) for qtype, rows in ((T.Q4_K, 16), (T.Q8_0, 8))
    ]


def _gguf_linear(parts: list[tuple[T, np.ndarray]], dtype: torch.dtype) -> Linear:
    """A fused GGUF projection of 256 columns, its parts loaded as the model loads them."""
    linear = Linear(256, sum(b.shape[0] for _, b in parts), True, dtype, "cpu", GGUF)
    row = 0
    for qtype, blocks in parts:
        tensor = GGUFTensor(torch.from_numpy(blocks), qtype, (blocks.shape[0], 256))
        linear.load(tensor, (row, blocks.shape[0]))
        row += blocks.shape[0]
    linear.bias.data.copy_(_randn(linear.out_features, seed=3))
    linear.pack()
    return linear


def _dequantized(parts: list[tuple[T, np.ndarray]]) -> torch.Tensor:
    """The gguf package's own dequantization of the parts, stacked."""
    return torch.cat([torch.from_numpy(quants.dequantize(b, t)) for t, b in parts])


def test_gguf_blocks_without_their_kernels_serve_dequantized(monkeypatch):
    # No GGUF kernels (a CPU without AVX2): `load` dequantizes the blocks into the dense
    # weight, which torch multiplies.
    monkeypatch.setattr(gguf_weights, "ggml_kernels", lambda: None)
    parts = _gguf_parts(np.random.default_rng(4))
    linear = _gguf_linear(parts, torch.float32)
    assert linear.formats() == ["float32 (dequantized Q4_K+Q8_0)"]
    assert torch.equal(linear.weight, _dequantized(parts))
    for rows in ROWS:  # the packed [in, out] layout sums in another order
        x = _randn(rows, 256, seed=rows)
        expected = F.linear(x, _dequantized(parts), linear.bias)
        torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(ggml_kernels() is None, reason="the GGUF kernels need AVX2, FMA and F16C")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_blocks_are_multiplied_in_their_blocks(dtype):
    parts = _gguf_parts(np.random.default_rng(5))
    linear = _gguf_linear(parts, dtype)
    assert linear.weight is None and linear.formats() == ["Q4_K", "Q8_0"]
    for rows in ROWS:  # int8-quantized activations, as llama.cpp: close, not equal
        x = _randn(rows, 256, seed=rows).to(dtype)
        reference = F.linear(x.float(), _dequantized(parts), linear.bias.float())
        assert ((linear(x).float() - reference).norm() / reference.norm()).item() < 0.015


class _Ops:
    """Stands in for the kernels module: a projection is the tuple of its arguments."""

    @staticmethod
    def Projection(*args):  # the C++ class's name
        return args


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_each_method_gives_the_decode_stack_its_own_arguments(quantization):
    linear = _packed(quantization, torch.bfloat16)
    method = linear.method
    scales = None if quantization is None else method.scales
    mins = method.mins if quantization == "int4" else None
    weight, *quantized, bias, blocks, types = linear.stack_projection(_Ops)
    assert weight is linear.weight and bias is linear.bias and blocks == types == []
    assert all(got is want for got, want in zip(quantized, (scales, mins), strict=True))


@pytest.mark.skipif(ggml_kernels() is None, reason="the GGUF kernels need AVX2, FMA and F16C")
def test_gguf_blocks_give_the_decode_stack_their_blocks_and_types():
    linear = _gguf_linear(_gguf_parts(np.random.default_rng(6)), torch.float32)
    weight, scales, mins, bias, blocks, types = linear.stack_projection(_Ops)
    assert weight is scales is mins is None and bias is linear.bias
    assert len(blocks) == 2 and all(b.dtype == torch.uint8 for b in blocks)
    assert types == linear.method.ggml[1] and len(types) == 2
