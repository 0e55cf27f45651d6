"""The decode stack (a decode-only step's layers in one native call) equals the Python
layer loop it replaces, bit for bit, and the engine takes it where it applies."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import AttentionMetadata
from engine.kernels import cpu_kernels_supported
from tests.engine.gguf_models import write_mixed_gguf
from tests.engine.tiny_models import make_tiny_model_dir

pytestmark = pytest.mark.skipif(
    not cpu_kernels_supported(), reason="the decode stack runs the AVX512-BF16 kernels"
)


class _Counted:
    """A decode stack that counts its calls."""

    def __init__(self, stack) -> None:
        self.stack, self.calls = stack, 0

    def forward(self, *args):
        self.calls += 1
        return self.stack.forward(*args)


def _decode_step(
    prompt_len: int, batch: int, query_len: int = 1
) -> tuple[torch.Tensor, AttentionMetadata]:
    """A step's inputs: `batch` requests of `prompt_len` cached tokens each, decoding one
    token, or `query_len` of them (the rest of a prompt over its cached prefix)."""
    seq_len = prompt_len + query_len
    blocks_per = (seq_len + 15) // 16
    tables = [list(range(r * blocks_per, (r + 1) * blocks_per)) for r in range(batch)]
    meta = AttentionMetadata.build([query_len] * batch, [seq_len] * batch, tables, 16, "cpu")
    return torch.arange(200, 200 + batch * query_len), meta


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with a bias
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_stack_equals_the_python_layers_bit_for_bit(tmp_path, quantization, arch, batch):
    path = make_tiny_model_dir(tmp_path, arch)
    llm = LLM(model=str(path), dtype="bfloat16", quantization=quantization, num_blocks=32)
    _assert_stack_equals_python_layers(llm, batch)


@pytest.mark.parametrize("batch", [1, 3])
def test_qwen3s_qk_norms_run_in_the_stack_bit_for_bit(tmp_path, batch):
    path = make_tiny_model_dir(tmp_path, "qwen3")
    llm = LLM(model=str(path), dtype="bfloat16", num_blocks=32)
    _assert_stack_equals_python_layers(llm, batch)


@pytest.mark.parametrize("batch", [1, 5])
def test_a_mixture_of_experts_runs_in_the_stack_bit_for_bit(tmp_path, batch):
    # Qwen3-MoE: a sparse layer, a dense one, a sparse one; at 5 rows tokens share experts
    path = make_tiny_model_dir(tmp_path, "qwen3_moe")
    llm = LLM(model=str(path), dtype="bfloat16", num_blocks=32)
    assert "decode stack" in llm.engine.core.compute_summary
    _assert_stack_equals_python_layers(llm, batch)


@pytest.mark.parametrize("batch", [1, 5])
def test_a_mixture_of_experts_gguf_runs_in_the_stack_from_its_blocks(tmp_path, batch):
    from gguf import GGMLQuantizationType

    from tests.engine.gguf_models import bpe_vocab, write_family_gguf
    from tests.engine.test_gguf_qwen3_moe import _model

    file = write_family_gguf(tmp_path / "moe.gguf", _model(), bpe_vocab("qwen2"),
                             qtype=GGMLQuantizationType.Q8_0)  # fmt: skip
    llm = LLM(model=str(file), cache_dir=str(tmp_path), num_blocks=32)
    summary = llm.engine.core.compute_summary
    assert "decode stack" in summary and "Q8_0 x" in summary
    _assert_stack_equals_python_layers(llm, batch)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_gguf_decodes_through_the_stack_from_its_blocks_bit_for_bit(tmp_path, batch):
    # Every GGUF kernel type in one model, and an IQ1_S projection served dequantized (bf16
    # through the skinny GEMM) among them: `auto` takes bf16 activations and the stack.
    llm = LLM(model=str(write_mixed_gguf(tmp_path / "mixed.gguf")), cache_dir=str(tmp_path),
              num_blocks=32)  # fmt: skip
    assert llm.engine.core.model.dtype == torch.bfloat16
    summary = llm.engine.core.compute_summary
    assert "decode stack" in summary and "Q4_K x" in summary
    _assert_stack_equals_python_layers(llm, batch)


def _assert_stack_equals_python_layers(llm: LLM, batch: int, query_len: int = 1) -> None:
    """The runner's decode stack against the model's one Python forward, on the same step."""
    core = llm.engine.core
    model, stack = core.model, core.runner.decode_stack
    assert stack is not None
    kv = core.runner.kv_caches
    g = torch.Generator().manual_seed(3)
    for k, v in kv:  # a context to attend to
        k.copy_(torch.randn(k.shape, generator=g).to(k.dtype))
        v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))
    ids, meta = _decode_step(prompt_len=40, batch=batch, query_len=query_len)
    counted = _Counted(stack.native)
    with torch.inference_mode():
        model.attn_backend.prepare(meta)
        kv_stack = [(k.clone(), v.clone()) for k, v in kv]
        stack.native = counted
        stacked = stack.run(ids, meta.positions, kv_stack, meta)
        stack.native = counted.stack
        kv_python = [(k.clone(), v.clone()) for k, v in kv]
        python = model(ids, meta.positions, kv_python, meta)
    assert counted.calls == 1 and stacked is not None
    assert torch.equal(stacked, python)
    for (ks, vs), (kp, vp) in zip(kv_stack, kv_python, strict=True):
        assert torch.equal(ks, kp) and torch.equal(vs, vp)  # the new tokens' K/V written alike


def test_generation_through_the_stack_equals_generation_without_it(tmp_path):
    path = make_tiny_model_dir(tmp_path)
    prompts = [[5, 6, 7, 8], list(range(300, 340)), [9] * 20]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with_stack = LLM(model=str(path), dtype="bfloat16", quantization="int4", num_blocks=32)
    without = LLM(model=str(path), dtype="bfloat16", quantization="int4", num_blocks=32)
    without.engine.core.runner.decode_stack = None
    stack = with_stack.engine.core.runner.decode_stack
    stack.native = counted = _Counted(stack.native)
    a = [o.token_ids for o in with_stack.generate(prompts, params)]
    b = [o.token_ids for o in without.generate(prompts, params)]
    assert a == b and all(len(t) == 24 for t in a)
    assert counted.calls >= 20  # every decode-only step (the prefill steps are not)


def test_no_stack_where_its_kernels_do_not_serve(tmp_path):
    path = make_tiny_model_dir(tmp_path)

    def stack(**options):
        core = LLM(model=str(path), num_blocks=16, **options).engine.core
        assert core.plan.decode_stack_rows == (core.runner.decode_stack or _NoStack).max_rows
        return core.runner.decode_stack

    assert stack(dtype="float32") is None
    assert stack(dtype="bfloat16", attention_backend="sdpa") is None
    assert stack(dtype="bfloat16", kv_cache_dtype="int8") is None  # torch's ops write int8 rows
    # bf16 weights go through the kernel up to 8 rows, int4 up to 64: the stack takes no more.
    assert stack(dtype="bfloat16").max_rows == 8
    assert stack(dtype="bfloat16", quantization="int4").max_rows == 64


class _NoStack:
    max_rows = 0
