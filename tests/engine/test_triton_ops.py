"""The Triton layer ops (engine/models/triton_ops.py) equal torch's ops they replace, and
the plan gives them to bf16 / fp16 models on CUDA only.

Marked `device`: under `make test` the kernels run on CPU tensors through Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1), on `--device cuda` compiled on the
GPU. The expected values are torch's ops on the same device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton comes with torch's CUDA build and xgrammar")

from engine import LLM  # noqa: E402
from engine.attention import AttentionMetadata, write_kv  # noqa: E402
from engine.attention.triton_paged import TritonBackend  # noqa: E402
from engine.execution_plan import ModelShape, _layer_ops  # noqa: E402
from engine.models.layer_ops import TorchOps, rms_norm  # noqa: E402
from engine.models.rotary import apply_rotary  # noqa: E402
from engine.models.triton_ops import TritonOps  # noqa: E402
from tests.engine.tiny_models import make_tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.device

DTYPES = [torch.bfloat16, torch.float32]


def rand(*shape: int, seed: int, dtype: torch.dtype, device, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def assert_rounds_as_torch(got: torch.Tensor, want: torch.Tensor, device) -> None:
    """Equal where the kernel's arithmetic is torch's own (the residual add): bit for bit
    on a GPU. Triton's interpreter converts float32 to bf16 by truncation, not to
    nearest (measured with triton 3.9, also with fp_downcast_rounding="rtne"), so there a
    bf16 value may be one ulp (2^-7 relative at most) off."""
    if device.type == "cuda" or got.dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0)


def assert_near_torch(got: torch.Tensor, want: torch.Tensor, device) -> None:
    """Close where the kernel's float32 math differs from torch's (the mean of squares'
    order, rsqrt, exp): float32 to 1e-5; bf16 on a GPU to an ulp, in under 2% of the
    elements; bf16 under the interpreter, whose every bf16 rounding truncates (above), to
    three ulps (two truncations and the float32 difference)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    elif device.type == "cuda":
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
        assert (got != want).float().mean().item() < 0.02
    else:
        torch.testing.assert_close(got, want, rtol=3 * 2**-7, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize(("rows", "width"), [(1, 576), (7, 2048), (3, 40)])
def test_add_rms_norm_is_the_residual_add_then_the_norm(rows, width, dtype, device):
    x = rand(rows, width, seed=1, dtype=dtype, device=device, scale=30.0)
    residual = rand(rows, width, seed=2, dtype=dtype, device=device, scale=30.0)
    weight = rand(width, seed=3, dtype=dtype, device=device).abs()
    normed, stream = TritonOps.add_rms_norm(x, residual, weight, 1e-5)
    assert_rounds_as_torch(stream, residual + x, device)  # the add rounds where torch's does
    assert_near_torch(normed, rms_norm(residual + x, weight, 1e-5), device)
    alone, same = TritonOps.add_rms_norm(x, None, weight, 1e-5)  # the first layer's
    assert same is x
    assert_near_torch(alone, rms_norm(x, weight, 1e-5), device)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (5, 2500), (2, 20)])
def test_silu_mul_is_silu_of_gate_times_up(rows, width, dtype, device):
    gate_up = rand(rows, 2 * width, seed=4, dtype=dtype, device=device, scale=4.0)
    gate_up[0, :4] = torch.tensor([-200.0, -60.0, 60.0, 200.0])  # exp's far ends
    got = TritonOps(None, F.silu).silu_mul(gate_up)
    assert_near_torch(got, TorchOps(None, F.silu).silu_mul(gate_up), device)


def quarters(*shape: int, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Values in -2..2 in steps of 1/4: their products and sums are exact in bf16, so no
    rounding (nor the interpreter's truncation) can hide a wrong element or head."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-8, 9, shape, generator=g) / 4).to(dtype).to(device)


@pytest.mark.parametrize("values", ["quarters", "normal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 16)])
def test_rope_write_kv_rotates_q_and_k_and_writes_k_and_v(heads, kv_heads, dim, dtype, values,
                                                          device):  # fmt: skip
    rows = 7
    make = quarters if values == "quarters" else rand
    qkv = make(rows, (heads + 2 * kv_heads) * dim, seed=5, dtype=dtype, device=device)
    cos = make(rows, dim, seed=6, dtype=dtype, device=device)
    sin = make(rows, dim, seed=7, dtype=dtype, device=device)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(8))[:rows].to(device)
    k_cache = torch.zeros(4, 16, kv_heads, dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    backend = TritonBackend(heads, kv_heads)
    q = TritonOps(backend, F.silu).rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots,
                                                 heads, kv_heads)  # fmt: skip

    split = qkv.view(rows, heads + 2 * kv_heads, dim)
    qk = apply_rotary(split[:, : heads + kv_heads], cos.unsqueeze(1), sin.unsqueeze(1))
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    write_kv(k_ref, v_ref, qk[:, heads:], split[:, heads + kv_heads :], slots)
    assert torch.equal(v_cache, v_ref)  # v is copied, not computed
    if values == "quarters" or (device.type == "cpu" and dtype == torch.float32):
        # Exact products and sums: every element and head where torch's ops put it.
        assert torch.equal(q, qk[:, :heads]) and torch.equal(k_cache, k_ref)
    else:
        # Rounded products: on the H200 float32 contracts into FMAs and bf16 moved an ulp
        # in some elements (measured 2026-11-28); the interpreter truncates each bf16
        # product and sum. An ulp of a product of two N(0, 1) values, never a wrong head.
        atol = 1e-5 if dtype == torch.float32 else 0.2
        torch.testing.assert_close(q, qk[:, :heads], rtol=0, atol=atol)
        torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=atol)


def test_a_bf16_layer_stack_with_triton_ops_gives_torch_ops_logits(tmp_path, device):
    """A tiny bf16 model's forward over a prompt, the Triton ops against torch's."""
    llm = LLM(model=str(make_tiny_model_dir(tmp_path)), dtype="bfloat16", num_blocks=16,
              device=str(device), attention_backend="triton", enforce_eager=True)  # fmt: skip
    core = llm.engine.core
    model = core.model
    ids = torch.arange(100, 130, device=device)
    meta = AttentionMetadata.build([30], [30], [[0, 1]], 16, device)
    kv = core.runner.kv_caches
    with torch.inference_mode():
        model.attn_backend.prepare(meta)
        model.ops = TritonOps(model.attn_backend, F.silu)
        fused = model.compute_logits(model(ids, meta.positions, kv, meta)).float()
        model.ops = TorchOps(model.attn_backend, F.silu)
        plain = model.compute_logits(model(ids, meta.positions, kv, meta)).float()
    # bf16 through 2 layers: the ops' last-ulp differences move logits by far less than
    # their spread, and the argmax (the greedy token) stays at nearly every position.
    assert (fused - plain).abs().max() < 0.05 * plain.abs().max()
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.9


def test_the_plan_gives_triton_ops_to_bf16_and_fp16_on_cuda_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    silu, gelu = ModelShape(4, 2, 16, silu=True), ModelShape(4, 2, 16, silu=False)
    assert _layer_ops(torch.bfloat16, cuda, None, silu, 1, False) == "triton"
    assert _layer_ops(torch.float16, cuda, None, silu, 1, False) == "triton"
    assert _layer_ops(torch.float32, cuda, None, silu, 1, False) == "torch"  # transformers'
    assert _layer_ops(torch.bfloat16, cuda, None, silu, 1, True) == "torch"  # int8 KV: sdpa
    assert _layer_ops(torch.bfloat16, cuda, None, gelu, 1, False) == "torch"
    assert _layer_ops(torch.bfloat16, cuda, None, silu, 2, False) == "torch"
    assert _layer_ops(torch.bfloat16, cpu, None, silu, 1, False) != "triton"
