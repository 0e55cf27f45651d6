"""Qwen3.5's decode steps through the native decode stack (engine/decode_stack.py): its Gated
DeltaNet layers on the rows' state slots, its gated full attention with (1 + w) q/k norms and
partial rotary, in one call. Its Python layers run torch's ops: the stack makes the same ATen
calls and kernel calls, so it equals them bit for bit, and greedy tokens are the same with
the stack and without it; with float32 weights through the stack they are transformers'
own."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine import LLM, SamplingParams
from engine.attention import AttentionMetadata
from engine.kernels import ggml_kernels
from engine.state_cache import StateMetadata
from tests.engine.gguf_models import write_family_gguf
from tests.engine.test_decode_stack import _Counted
from tests.engine.test_engine_golden import engine_greedy, hf_greedy
from tests.engine.test_gguf_qwen35 import _model, _vocab

pytestmark = pytest.mark.skipif(ggml_kernels() is None, reason="the float32 kernels need AVX2")

BLOCK = 4


@pytest.fixture(scope="module")
def q8_0(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qwen35_stack")
    return write_family_gguf(root / "q8_0.gguf", _model(), _vocab(), qtype=T.Q8_0)


def _llm(path: Path, **options) -> LLM:
    """The file served as `auto` does on a CPU without AVX512-BF16: float32 activations on
    its blocks (forced where this CPU has AVX512-BF16)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("engine.kernels.cpu_kernels", lambda: None)
        llm = LLM(model=str(path), cache_dir=str(path.parent), block_size=BLOCK, num_blocks=128,
                  state_slots=16, **options)  # fmt: skip
    assert llm.engine.core.model.dtype == torch.float32
    return llm


def _step(
    batch: int, slots: list[int], saves: list[tuple]
) -> tuple[torch.Tensor, AttentionMetadata]:
    """A decode step of `batch` requests over 40 cached tokens each, on state `slots`."""
    seq_len = 41
    per = -(-seq_len // BLOCK)
    tables = [list(range(r * per, (r + 1) * per)) for r in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [seq_len] * batch, tables, BLOCK, "cpu")
    states = StateMetadata(
        slots=slots, copies=[], zeros=[], saves=saves,
        decode_rows=torch.arange(batch), decode_slots=torch.tensor(slots),
        prefills=[], query_start=list(range(batch + 1)),
    )  # fmt: skip
    return torch.arange(200, 200 + batch), dataclasses.replace(meta, states=states)


@pytest.mark.parametrize(("batch", "kv_cache_dtype"), [(1, "auto"), (3, "auto"), (3, "int8")])
def test_the_stack_equals_the_python_layers(q8_0, batch, kv_cache_dtype):
    llm = _llm(q8_0, kv_cache_dtype=kv_cache_dtype)
    core = llm.engine.core
    assert "decode stack" in core.compute_summary
    model, stack = core.model, core.runner.decode_stack
    assert stack is not None
    g = torch.Generator().manual_seed(3)
    kv = core.runner.kv_caches  # the linear layers': (conv states, recurrent states)
    assert (kv[3][0].dtype == torch.int8) == (kv_cache_dtype == "int8")  # the full layer's
    for k, v in kv:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    slots = [2, 9, 5][:batch]
    # the first request's snapshot after its token, into slot 11 (`_save_after_decode`)
    saves = [((1, 11),)] + [()] * (batch - 1)
    ids, meta = _step(batch, slots, saves)
    counted = _Counted(stack.native)
    with torch.inference_mode():
        model.prepare_attention(meta)
        kv_stack = [(k.clone(), v.clone()) for k, v in kv]
        stack.native = counted
        stacked = stack.run(ids, meta.positions, kv_stack, meta)
        stack.native = counted.stack
        kv_python = [(k.clone(), v.clone()) for k, v in kv]
        python = model(ids, meta.positions, kv_python, meta)
    assert counted.calls == 1 and stacked is not None
    assert torch.equal(stacked, python)
    changed = 0
    for (ks, vs), (kp, vp), (k, v) in zip(kv_stack, kv_python, kv, strict=True):
        # every new K/V row, conv input and recurrent state written alike
        assert torch.equal(ks, kp) and torch.equal(vs, vp)
        changed += int(not torch.equal(ks, k)) + int(not torch.equal(vs, v))
    assert changed == 2 * len(kv)
    for i, layer in enumerate(model.layers):
        if layer.linear_attn is not None:  # the snapshot: the slot's state after the token
            for t in kv_stack[i]:
                assert torch.equal(t[11], t[2])


def test_no_stack_for_a_step_with_a_prefill(q8_0):
    llm = _llm(q8_0)
    core = llm.engine.core
    stack = core.runner.decode_stack
    ids, meta = _step(2, [1, 2], [(), ()])
    meta = dataclasses.replace(meta, states=dataclasses.replace(meta.states, prefills=[1]))
    with torch.inference_mode():
        core.model.prepare_attention(meta)
        assert stack.run(ids, meta.positions, core.runner.kv_caches, meta) is None


def test_generation_through_the_stack_equals_generation_without_it(q8_0):
    prompts = [[5, 17, 300, 42, 99, 7, 250, 11], list(range(40, 75)), [9] * 13]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    # a snapshot at every block: decode steps write some (`_save_after_decode`)
    with_stack = _llm(q8_0, state_snapshot_interval=1)
    without = _llm(q8_0, state_snapshot_interval=1)
    without.engine.core.runner.decode_stack = None
    stack = with_stack.engine.core.runner.decode_stack
    stack.native = counted = _Counted(stack.native)

    def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    got = greedy(with_stack, prompts)
    assert got == greedy(without, prompts) and all(len(t) == 16 for t in got)
    assert counted.calls >= 14  # every decode-only step
    # Each prompt and its output again: resumed from the snapshots its decodes wrote.
    longer = [p + t for p, t in zip(prompts, got, strict=True)]
    outs = with_stack.generate(longer, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == greedy(without, longer)
    assert all(o.num_cached_tokens > len(p) for o, p in zip(outs, prompts, strict=True))


def test_greedy_tokens_through_the_stack_are_transformers(tmp_path):
    """The F32 file of tests/engine/test_gguf_qwen35.py, its float32 projections through the
    stack (torch's matmul, as the Python layers), the rest through the kernels: token for
    token transformers' greedy output. (A float32 checkpoint keeps torch's ops and SDPA, the
    reference path: the float32 kernels are made to serve it here.)"""
    file = write_family_gguf(tmp_path / "f32.gguf", _model(), _vocab())
    prompts = [[5, 17, 300, 42, 99, 7, 250, 11], list(range(40, 75))]
    expected = hf_greedy(None, prompts, 12, hf=_model())
    native = ggml_kernels()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("engine.kernels.layer_kernels", lambda dtype, device, quantization: native)
        llm = LLM(model=str(file), dtype="float32", block_size=BLOCK, num_blocks=128,
                  state_slots=16, cache_dir=str(tmp_path))  # fmt: skip
        assert "decode stack" in llm.engine.core.compute_summary
        stack = llm.engine.core.runner.decode_stack
        stack.native = counted = _Counted(stack.native)
        assert engine_greedy(llm, prompts, 12) == expected
    assert counted.calls >= 10


def test_a_partial_rotary_phi3_decodes_through_the_stack_as_without_it(tmp_path):
    """Phi-3 with plain rope and partial rotary (no LongRoPE) takes the same stack, its Python
    layers on torch's ops (partial rotary): greedy tokens equal those without the stack."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.engine.gguf_models import spm_vocab

    vocab = spm_vocab()
    config = AutoConfig.for_model(
        "phi3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, max_position_embeddings=512, rms_norm_eps=1e-6,
        num_hidden_layers=2, tie_word_embeddings=False, vocab_size=len(vocab["tokens"]),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
        bos_token_id=vocab["bos"], eos_token_id=vocab["eos"], pad_token_id=vocab["pad"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    file = write_family_gguf(tmp_path / "phi3.gguf", model, vocab, qtype=T.Q8_0)
    prompts = [[5, 17, 300, 42, 99, 7, 250, 11], list(range(40, 75))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with_stack, without = _llm(file), _llm(file)
    without.engine.core.runner.decode_stack = None
    stack = with_stack.engine.core.runner.decode_stack
    assert stack is not None and "decode stack" in with_stack.engine.core.compute_summary
    stack.native = counted = _Counted(stack.native)
    got = [o.token_ids for o in with_stack.generate(prompts, params, use_tqdm=False)]
    assert got == [o.token_ids for o in without.generate(prompts, params, use_tqdm=False)]
    assert counted.calls >= 10
