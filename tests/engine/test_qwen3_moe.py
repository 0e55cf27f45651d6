"""Qwen3-MoE (a mixture of experts in place of the MLP, a dense layer beside the sparse
ones) token for token with transformers (float32 greedy): batched, repeated as prefix-cache
hits, through preemption and speculation; the tokens grouped by expert so each chosen
expert runs once per step; every block back at the end."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import cpu_kernels, ggml_kernels
from engine.models.layer_ops import TorchOps, activation, rms_norm
from engine.models.moe import SparseMoE
from tests.engine.test_engine_golden import (
    assert_all_blocks_free,
    assert_preempted_and_chunked_match,
    engine_greedy,
    hf_greedy,
    random_prompts,
)
from tests.engine.test_speculative import assert_oracle_speculation_matches
from tests.engine.tiny_models import make_tiny_model_dir

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("qwen3_moe"), arch="qwen3_moe", seed=3)
    prompts = random_prompts(seed=5, n=4, vocab=1000, shared_prefix=30)
    return path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


def test_batch_and_prefix_cache_hits_match_transformers(qwen3_moe):
    path, prompts, expected = qwen3_moe
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_blocks=256)
    layers = llm.engine.core.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["SparseMoE", "GatedMLP", "SparseMoE"]
    assert engine_greedy(llm, prompts, NEW_TOKENS) == expected
    # Again: each prompt's prefix is now a cache hit, fewer rows computed per step.
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.num_cached_tokens == (len(prompt) - 1) // 4 * 4
    assert_all_blocks_free(llm)


def test_preemption_and_chunked_prefill_match_transformers(qwen3_moe):
    assert_preempted_and_chunked_match(*qwen3_moe, NEW_TOKENS)


def test_speculation_matches_transformers(qwen3_moe):
    assert_oracle_speculation_matches(*qwen3_moe, NEW_TOKENS)


def test_each_chosen_expert_runs_once_per_step_on_its_tokens(qwen3_moe):
    """The grouped forward equals each token through its own k experts, and calls each
    chosen expert once, on exactly the tokens that chose it."""
    path, _, _ = qwen3_moe
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_blocks=64)
    moe = llm.engine.core.model.layers[0].mlp
    assert isinstance(moe, SparseMoE)
    ops = TorchOps(None, activation("silu"), rms_norm)
    x = torch.randn(24, moe.gate.shape[1], generator=torch.Generator().manual_seed(0))
    weights, experts = moe.route(x)
    calls: dict[int, int] = {}
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda m, a, out, e=e: calls.update({e: a[1].shape[0]}))
    got = moe(ops, x)
    chosen = torch.bincount(experts.flatten(), minlength=len(moe.experts))
    assert calls == {e: int(n) for e, n in enumerate(chosen) if n}
    assert len(calls) > moe.spec.top_k  # the tokens chose different experts
    want = torch.stack([
        sum(w * moe.experts[int(e)](ops, x[t : t + 1])[0] for w, e in zip(weights[t], experts[t], strict=True))
        for t in range(x.shape[0])
    ])  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # norm_topk_prob: the k weights of a token sum to 1
    torch.testing.assert_close(weights.sum(-1), torch.ones(x.shape[0]))


# Each native build where this CPU (or $PAGEDSERVE_CPU_KERNELS) has it: on an AVX-512 BF16 CPU
# both; the AVX2 pass of `make test` runs the GGUF build's AVX2 code.
BUILDS = [
    pytest.param("cpu_kernels", marks=pytest.mark.skipif(
        cpu_kernels() is None, reason="the bf16 build needs AVX512-BF16")),
    pytest.param("ggml_kernels", marks=pytest.mark.skipif(
        ggml_kernels() is None, reason="the GGUF build needs AVX2")),
]  # fmt: skip


@pytest.mark.parametrize("build", BUILDS)
def test_the_native_weighted_sum_is_torchs(build):
    """`moe_sum` of a native build against TorchOps' index_add_: float32 bit for bit (the
    pairs added in their order, as transformers adds them); bf16 within a rounding (each
    product rounded alike, the sum kept in float32 and rounded once)."""
    import engine.kernels as kernels

    native = getattr(kernels, build)()
    g = torch.Generator().manual_seed(1)
    counts, tokens_n = [3, 1, 5, 2], 6
    tokens = torch.randint(0, tokens_n, (sum(counts),), generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        ys = [torch.randn(n, 64, generator=g).to(dtype) for n in counts]
        weights = torch.rand(sum(counts), generator=g).to(dtype)
        want = TorchOps(None, activation("silu"), rms_norm).moe_sum(ys, tokens, weights, tokens_n)
        got = native.moe_sum(ys, tokens, weights, tokens_n)
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
