"""The float32 layer ops, paged decode attention and decode stack (AVX2; both builds of the
kernels have them) equal the torch ops they replace, and serve a GGUF's float32 path."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.attention import get_attention_backend, write_kv
from engine.attention.cpu_paged import KERNEL_MAX_QUERY
from engine.attention.reference import reference_paged_attention
from engine.config import EngineConfig
from engine.execution_plan import ModelShape, resolve_attention
from engine.kernels import build_name, ggml_kernels, layer_kernels, switch
from engine.models.layer_ops import TorchOps, rms_norm
from engine.models.rotary import apply_rotary
from tests.engine.gguf_models import write_mixed_gguf
from tests.engine.test_attention import attend, make_batch, random_shapes
from tests.engine.test_decode_stack import _assert_stack_equals_python_layers, _Counted

pytestmark = pytest.mark.skipif(ggml_kernels() is None, reason="the float32 kernels need AVX2")


def _f32(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize(("rows", "width"), [(1, 576), (5, 576), (300, 2048), (3, 44)])
def test_add_rms_norm_is_the_residual_add_then_transformers_rmsnorm(rows, width):
    x, residual = _f32(rows, width, seed=1, scale=30.0), _f32(rows, width, seed=2, scale=30.0)
    weight = _f32(width, seed=3).abs()
    normed, stream = ggml_kernels().add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(stream, residual + x)
    # The mean of squares is summed in another order: a few ulps.
    torch.testing.assert_close(normed, rms_norm(residual + x, weight, 1e-5), rtol=1e-5, atol=1e-6)
    alone, same = ggml_kernels().add_rms_norm(x, None, weight, 1e-5)
    assert same is x or torch.equal(same, x)
    torch.testing.assert_close(alone, rms_norm(x, weight, 1e-5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_rope_write_kv_equals_apply_rotary_and_write_kv_bit_for_bit(rows):
    heads, kv_heads, dim = 9, 3, 64
    qkv = _f32(rows, (heads + 2 * kv_heads) * dim, seed=4)
    cos, sin = _f32(rows, dim, seed=5), _f32(rows, dim, seed=6)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(7))[:rows]
    k_cache = torch.zeros(4, 16, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    q = ggml_kernels().rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)

    split = qkv.view(rows, heads + 2 * kv_heads, dim)
    qk = apply_rotary(split[:, : heads + kv_heads], cos.unsqueeze(1), sin.unsqueeze(1))
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    write_kv(k_ref, v_ref, qk[:, heads:], split[:, heads + kv_heads :], slots)
    assert torch.equal(q, qk[:, :heads])
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ggml_kernels().rope_write_kv(qkv[:1], cos[:1], sin[:1], k_cache, v_cache,
                                     torch.tensor([64]), heads, kv_heads)  # fmt: skip


@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (20, 1536), (2, 20)])
def test_silu_mul_equals_silu_of_gate_times_up(rows, width):
    gate_up = _f32(rows, 2 * width, seed=10, scale=4.0)
    gate_up[0, :4] = torch.tensor([-200.0, -60.0, 60.0, 200.0])  # exp's clamps, both ends
    gate, up = gate_up.split(width, dim=-1)
    got = ggml_kernels().silu_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_float32_kernels_serve_a_gguf_s_blocks_only():
    # The float32 reference (a Hugging Face checkpoint, --dtype float32) stays torch's ops.
    assert layer_kernels(torch.float32, "cpu", "gguf") is ggml_kernels()
    assert layer_kernels(torch.float32, "cpu", None) is None
    assert layer_kernels(torch.float32, "meta", "gguf") is None
    shape, cpu, auto = ModelShape(6, 2, 64, silu=True), torch.device("cpu"), EngineConfig()
    assert resolve_attention(auto, cpu, torch.float32, "gguf", shape) == "cpu-paged"
    assert resolve_attention(auto, cpu, torch.float32, None, shape) == "sdpa"
    with pytest.raises(ValueError, match="float32 on a GGUF's blocks"):
        resolve_attention(EngineConfig(attention_backend="cpu-paged"), cpu, torch.float32, None,
                          shape)  # fmt: skip


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(6, 2, 16), (6, 1, 64), (4, 4, 32), (10, 2, 64)]
)
@pytest.mark.parametrize("seed", range(3))
def test_cpu_paged_float32_equals_reference_over_long_and_mixed_steps(
    num_heads, num_kv_heads, head_dim, seed
):
    """Decodes of up to 700 tokens (several 256-token chunks merged) among prefills."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    shapes = random_shapes(rng, 5) + [(1, rng.randint(1, 700)) for _ in range(5)] + [(1, 257)]
    rng.shuffle(shapes)
    q, k_cache, v_cache, meta, _ = make_batch(
        rng, shapes, num_heads, num_kv_heads, head_dim, torch.float32
    )
    scale = head_dim**-0.5
    backend = get_attention_backend("cpu-paged", num_heads, num_kv_heads)
    out = attend(backend, q, k_cache, v_cache, meta, scale)
    ref = reference_paged_attention(q, k_cache, v_cache, meta, scale)
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("long_query", [False, True])
def test_cpu_paged_takes_short_queries_as_kernel_rows_and_long_ones_through_sdpa(long_query):
    """Queries of up to KERNEL_MAX_QUERY tokens (a chunk over a cached prefix, a fresh
    prompt) attend through the kernel, a row per token, so a step of only such queries is
    the decode stack's; a longer one goes through SDPA; either way the reference's output."""
    rng = random.Random(7)
    torch.manual_seed(7)
    shapes = [(1, 40), (16, 16 + 48), (KERNEL_MAX_QUERY, KERNEL_MAX_QUERY), (5, 30)]
    if long_query:
        shapes.append((KERNEL_MAX_QUERY + 1, KERNEL_MAX_QUERY + 33))
    q, k_cache, v_cache, meta, _ = make_batch(rng, shapes, 8, 2, 64, torch.float32)
    backend = get_attention_backend("cpu-paged", 8, 2)
    out = attend(backend, q, k_cache, v_cache, meta, 0.125)
    assert (backend.kernel_only_tables() is None) == long_query
    ref = reference_paged_attention(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_paged_decode_over_shared_prefixes_gives_each_request_its_alone_result():
    """The kernel runs the tasks that read one cached block together (requests sharing a
    prefix, whatever their order in the step) and splits them between threads by keys:
    each request's output is still its own, bit for bit what it gets alone."""
    torch.manual_seed(3)
    blocks, block_size, kv_heads, heads, dim = 64, 16, 2, 8, 64
    k_cache = torch.randn(blocks, block_size, kv_heads, dim)
    v_cache = torch.randn(blocks, block_size, kv_heads, dim)
    prefixes = [list(range(0, 20)), list(range(20, 37))]  # 320 and 272 tokens of blocks
    tables, lens = torch.zeros(9, 24, dtype=torch.int32), []
    for r in range(9):  # alternating prefixes, each with blocks of its own after it
        row = prefixes[r % 2] + [37 + 3 * r, 38 + 3 * r]
        tables[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
        lens.append(len(prefixes[r % 2]) * block_size + 5 + r)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(9, heads, dim)
    kernel = ggml_kernels()
    together = kernel.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125)
    for r in range(9):
        alone = kernel.paged_decode_attention(q[r : r + 1], k_cache, v_cache, tables[r : r + 1],
                                              seq_lens[r : r + 1], 0.125)  # fmt: skip
        assert torch.equal(together[r : r + 1], alone), r


def test_paged_decode_kernel_rejects_what_it_cannot_attend():
    kernel = ggml_kernels()
    tables, lens = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    q, cache = torch.zeros(1, 4, 12), torch.zeros(2, 4, 2, 12)
    with pytest.raises(RuntimeError, match="multiple of"):
        kernel.paged_decode_attention(q, cache, cache, tables, lens, 1.0)
    q, cache = torch.zeros(1, 4, 16), torch.zeros(2, 4, 2, 16)
    with pytest.raises(RuntimeError, match="q.s dtype"):
        kernel.paged_decode_attention(q, cache.double(), cache, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="seq_len out of range"):
        kernel.paged_decode_attention(q, cache, cache, tables, lens * 9, 1.0)


@pytest.fixture(scope="module")
def float32_gguf(tmp_path_factory) -> Path:
    """A GGUF of every type the kernels multiply (3 of the mixed file's layers)."""
    return write_mixed_gguf(tmp_path_factory.mktemp("f32") / "mixed.gguf", layers=3)


def _float32_llm(gguf: Path, **options) -> LLM:
    """The GGUF served as `auto` does on a CPU without AVX512-BF16: float32 activations on
    its blocks (forced where this CPU has AVX512-BF16, whose module carries the float32
    kernels too)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("engine.kernels.cpu_kernels", lambda: None)
        llm = LLM(model=str(gguf), cache_dir=str(gguf.parent), num_blocks=32, **options)
    assert llm.engine.core.model.dtype == torch.float32
    return llm


@pytest.fixture(scope="module")
def float32_gguf_llm(float32_gguf) -> LLM:
    return _float32_llm(float32_gguf)


@pytest.mark.parametrize(("batch", "query_len"), [(1, 1), (3, 1), (3, 5)])
def test_a_float32_gguf_decodes_through_the_stack_bit_for_bit(float32_gguf_llm, batch, query_len):
    """Decodes, and short queries over a cached prefix (kernel rows: the stack takes them)."""
    summary = float32_gguf_llm.engine.core.compute_summary
    # The build that serves: this CPU's, or the one `make test`'s AVX2 or VNNI pass forces
    # (the plan then names the switch).
    build = build_name(ggml_kernels())
    assert build.endswith(f"$PAGEDSERVE_CPU_KERNELS={switch()}") or switch() == "auto"
    assert summary.startswith(f"attention cpu-paged, CPU kernels {build} (fused ops, decode stack)")
    assert "Q4_K x" in summary, summary
    _assert_stack_equals_python_layers(float32_gguf_llm, batch, query_len)


def test_float32_gguf_generation_follows_the_torch_ops(float32_gguf, float32_gguf_llm):
    """Greedy tokens through the decode stack and fused ops equal those of torch's ops
    on the same blocks (SDPA attention, no fused ops): only summation order differs."""
    llm = float32_gguf_llm
    stack = llm.engine.core.runner.decode_stack
    stack.native = counted = _Counted(stack.native)
    plain = _float32_llm(float32_gguf, attention_backend="sdpa")
    model = plain.engine.core.model
    model.ops = TorchOps(model.attn_backend, F.silu)  # torch's layer ops, not the kernels'
    assert plain.engine.core.runner.decode_stack is None
    prompts = [[5, 6, 7, 8], list(range(300, 340))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    stack.native = counted.stack
    assert got == want and all(len(t) == 16 for t in got)
    assert counted.calls >= 14
