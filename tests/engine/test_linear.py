"""Projections: the skinny GEMM kernel, int8 and int4 weights, and the layout `Linear.pack`
picks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_kernels, cpu_kernels_supported
from engine.models import linear as linear_module
from engine.models.linear import (
    INT4_GROUP,
    INT8_GROUP,
    Linear,
    dequantize_int4,
    dequantize_int8,
    kernel_for,
    project,
    project_int8,
    quantize_int4,
    quantize_int8,
)

needs_kernel = pytest.mark.skipif(
    not cpu_kernels_supported(), reason="the skinny GEMM kernel needs AVX512-BF16"
)


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _close_to(got: torch.Tensor, expected_fp32: torch.Tensor) -> None:
    """Equal up to bf16 output rounding and a different fp32 summation order."""
    scale = expected_fp32.abs().max().item() + 1e-6
    torch.testing.assert_close(got.float(), expected_fp32, atol=scale * 8e-3, rtol=8e-3)


@needs_kernel
def test_the_kernel_builds_where_the_cpu_has_avx512_bf16():
    assert cpu_kernels() is not None


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 64), (64, 96), (100, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_kernel_equals_a_float32_matmul(m, n, k, with_bias):
    x, w = _bf16(m, k, seed=1), _bf16(n, k, seed=2)
    bias = _bf16(n, seed=3) if with_bias else None
    got = cpu_kernels().skinny_linear(x, w, None, bias)
    expected = x.float() @ w.float().t() + (bias.float() if with_bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    _close_to(got, expected)


@needs_kernel
@pytest.mark.parametrize("m", [1, 3, 4, 5, 9, 33])  # >4 rows: the dequantized-tile path
@pytest.mark.parametrize(("n", "k"), [(5, 64), (64, 128), (100, 576)])
def test_int8_kernel_equals_a_matmul_on_the_dequantized_weight(m, n, k):
    x, w = _bf16(m, k, seed=4), _bf16(n, k, seed=5)
    bias = _bf16(n, seed=6)
    q, scales = quantize_int8(w)
    got = cpu_kernels().skinny_linear(x, q, scales, bias)
    expected = x.float() @ dequantize_int8(q, scales, torch.bfloat16).float().t() + bias.float()
    _close_to(got, expected)


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 33])  # <=4 rows exact, >4 dequantized tile
@pytest.mark.parametrize(("n", "k"), [(1, 64), (5, 64), (13, 192), (100, 576)])
def test_int4_kernel_equals_a_matmul_on_the_dequantized_weight(m, n, k):
    x, w = _bf16(m, k, seed=4), _bf16(n, k, seed=5)
    bias = _bf16(n, seed=6)
    blocks = quantize_int4(w)
    got = cpu_kernels().int4_linear(x, *blocks, bias)
    expected = x.float() @ dequantize_int4(*blocks).t() + bias.float()
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    _close_to(got, expected)


@needs_kernel
def test_int4_kernel_dequantizes_as_torch_does():
    blocks = quantize_int4(_bf16(40, 192, seed=7).float())
    got = cpu_kernels().dequantize_int4(*blocks)
    torch.testing.assert_close(got, dequantize_int4(*blocks).to(torch.bfloat16), rtol=0, atol=0)


def _on_a_q4_1_grid(n: int, k: int, seed: int) -> torch.Tensor:
    """Weights as a Q4_1 GGUF dequantizes them: q * d + m with d and m float16, every
    block using 0 and 15."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // INT4_GROUP, INT4_GROUP), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // INT4_GROUP, 1, generator=g) * 0.01 + 1e-4).half().float()
    m = (-torch.rand(n, k // INT4_GROUP, 1, generator=g) * 0.1).half().float()
    return (q * d + m).view(n, k)


def test_int4_gives_back_q4_1_blocks_exactly_and_rounds_other_weights_to_half_a_step():
    on_grid = _on_a_q4_1_grid(8, 128, seed=8)
    assert torch.equal(dequantize_int4(*quantize_int4(on_grid)), on_grid)
    w = _bf16(16, 128, seed=9).float()
    w[3] = 0.5  # a constant block must not divide by zero
    packed, scales, mins = quantize_int4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (16, 64)
    assert scales.shape == mins.shape == (16, 128 // INT4_GROUP)
    step = scales.repeat_interleave(INT4_GROUP, dim=1)
    assert torch.all((dequantize_int4(packed, scales, mins) - w).abs() <= step / 2 + 1e-6)
    assert torch.equal(dequantize_int4(packed, scales, mins)[3], torch.full((128,), 0.5))


@needs_kernel
def test_kernel_rejects_what_it_cannot_multiply():
    kernel = cpu_kernels()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.skinny_linear(_bf16(1, 48, seed=0), _bf16(4, 48, seed=0), None, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel.skinny_linear(torch.randn(1, 32), _bf16(4, 32, seed=0), None, None)
    q, _ = quantize_int8(_bf16(4, 64, seed=0))
    with pytest.raises(RuntimeError, match="int8 weights need scales"):
        kernel.skinny_linear(_bf16(1, 64, seed=0), q, None, None)


def test_int8_round_trip_error_is_at_most_half_a_step_per_group():
    w = _bf16(16, 256, seed=7).float()
    w[3] = 0  # an all-zero row must not divide by zero
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (16, 256 // INT8_GROUP)
    back = dequantize_int8(q, scales, torch.float32)
    step = scales.repeat_interleave(INT8_GROUP, dim=1)
    assert torch.all((back - w).abs() <= step / 2 + 1e-7)
    assert torch.equal(back[3], torch.zeros(256))


class _CountingKernel:
    """Stands in for the compiled module: records the rows each call gets."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def skinny_linear(self, x, weight, scales, bias):
        self.rows.append(x.shape[0])
        if scales is not None:
            weight = dequantize_int8(weight, scales, x.dtype)
        return F.linear(x, weight, bias)


def _kernel_applies(x: torch.Tensor, weight: torch.Tensor, scales=None) -> bool:
    """Whether `project` (`project_int8` with scales) multiplies x by weight through the
    kernel `kernel_for` picks."""
    if kernel_for(weight) is None:
        return False
    counting = _CountingKernel()
    if scales is None:
        project(x, weight, kernel=counting)
    else:
        project_int8(x, weight, scales, None, counting)
    return counting.rows == [x.shape[0]]


def test_kernel_applies_only_to_few_bf16_rows_on_a_multiple_of_32():
    w = _bf16(8, 64, seed=0)
    rows = linear_module.SKINNY_MAX_ROWS
    expected = cpu_kernels() is not None
    assert _kernel_applies(_bf16(rows, 64, seed=0), w) is expected
    assert not _kernel_applies(_bf16(rows + 1, 64, seed=0), w)
    assert not _kernel_applies(_bf16(1, 48, seed=0), _bf16(8, 48, seed=0))
    assert not _kernel_applies(torch.randn(1, 64), torch.randn(8, 64))
    q, scales = quantize_int8(w)
    int8_rows = linear_module.INT8_KERNEL_MAX_ROWS
    assert _kernel_applies(_bf16(int8_rows, 64, seed=0), q, scales) is expected


def _loaded(
    in_f: int, out_f: int, dtype: torch.dtype, bias: bool = True, quantization=None
) -> Linear:
    layer = Linear(in_f, out_f, bias, dtype, torch.device("cpu"), quantization)
    layer.weight.data.copy_(torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(8)))
    if bias:
        layer.bias.data.copy_(torch.randn(out_f, generator=torch.Generator().manual_seed(9)))
    return layer


def test_float32_pack_stores_in_by_out_and_multiplies_the_same():
    layer = _loaded(64, 96, torch.float32)
    x = torch.randn(12, 64)
    before = layer(x)
    layer.pack()
    assert layer.weight.shape == (96, 64) and layer.weight.stride() == (1, 96)
    torch.testing.assert_close(layer(x), before, rtol=1e-6, atol=1e-5)


ROW_COUNTS = [1, 4, 5, 8, 9, 64, 65]  # kernel paths, torch / dequantized


@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_a_bf16_linear_equals_its_reference_at_every_row_count(rows):
    x = _bf16(rows, 128, seed=10)
    layer = _loaded(128, 40, torch.bfloat16)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack()
    _close_to(layer(x), x.float() @ weight.float().t() + bias.float())


# Quantized weights are refused without the kernels (tests/engine/test_config.py).
@pytest.mark.skipif(not cpu_kernels_supported(), reason="quantized weights need AVX512-BF16")
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_int8_and_int4_linears_equal_their_reference_at_every_row_count(rows):
    x = _bf16(rows, 128, seed=10)
    bias = _loaded(128, 40, torch.bfloat16).bias.detach().clone()
    int8 = _loaded(128, 40, torch.bfloat16, quantization="int8")
    deq = dequantize_int8(*quantize_int8(int8.weight.detach()), torch.bfloat16)
    int8.pack()
    assert int8.weight.dtype == torch.int8 and int8.method.scales is not None
    _close_to(int8(x), x.float() @ deq.float().t() + bias.float())
    int4 = _loaded(128, 40, torch.bfloat16, quantization="int4")
    assert int4.weight.dtype == torch.float32  # loaded in float32, rounded once by pack
    deq = dequantize_int4(*quantize_int4(int4.weight.detach()))
    int4.pack()
    assert int4.weight.dtype == torch.uint8 and int4.method.mins is not None
    _close_to(int4(x), x.float() @ deq.t() + bias.float())


def test_quantized_pack_refuses_a_row_that_is_not_whole_groups():
    with pytest.raises(ValueError, match=f"divisible by {INT8_GROUP}"):
        _loaded(96, 8, torch.bfloat16, quantization="int8").pack()
    with pytest.raises(ValueError, match="divisible by 64"):
        _loaded(96, 8, torch.bfloat16, quantization="int4").pack()
    with pytest.raises(ValueError, match="unknown quantization"):
        _loaded(64, 8, torch.bfloat16, quantization="int3")


def test_project_serves_the_lm_head_in_any_dtype():
    head = _bf16(300, 64, seed=11)
    hidden = _bf16(2, 64, seed=12)
    _close_to(project(hidden, head, kernel=kernel_for(head)), hidden.float() @ head.float().t())
    head32 = head.float()
    torch.testing.assert_close(
        project(hidden.float(), head32, kernel=kernel_for(head32)),
        F.linear(hidden.float(), head32),
    )
