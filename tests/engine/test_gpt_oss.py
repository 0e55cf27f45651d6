"""gpt-oss (issue 66) token for token with transformers (float32 greedy): attention sinks,
a sliding-window layer beside a full one, YaRN, q/k/v/o biases, and a mixture of experts
with a biased router (softmax over the top-k logits) and biased experts behind a clamped
SwiGLU, their weights split from transformers' stacked, interleaved tensors. Batched,
repeated as prefix-cache hits, chunked and preempted, and speculated; every block back."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import get_attention_backend
from engine.attention.reference import reference_paged_attention
from engine.kernels import ggml_kernels
from engine.models.moe import SparseMoE
from tests.engine.test_attention import make_batch
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
def gpt_oss(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("gpt_oss"), arch="gpt_oss", seed=4)
    # prompts longer than the window (8), sharing a prefix longer than it
    prompts = random_prompts(seed=6, n=4, vocab=1000, shared_prefix=20)
    return path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


def test_batch_and_prefix_cache_hits_match_transformers(gpt_oss):
    path, prompts, expected = gpt_oss
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_blocks=256)
    model = llm.engine.core.model
    assert all(isinstance(layer.mlp, SparseMoE) for layer in model.layers)
    assert [layer.self_attn.sliding_window for layer in model.layers] == [8, None]
    assert llm.engine.core.config.plan.attention == "sdpa"  # (the paged kernels take no sinks)
    assert engine_greedy(llm, prompts, NEW_TOKENS) == expected
    # Again: each prompt's prefix is now a cache hit, fewer rows computed per step.
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    assert all(o.num_cached_tokens > 0 for o in outs)
    assert_all_blocks_free(llm)


def test_preemption_and_chunked_prefill_match_transformers(gpt_oss):
    assert_preempted_and_chunked_match(*gpt_oss, NEW_TOKENS)


def test_speculation_matches_transformers(gpt_oss):
    assert_oracle_speculation_matches(*gpt_oss, NEW_TOKENS)


def test_the_sinks_and_the_clamps_change_the_answer(gpt_oss):
    """Controls: with the sinks at -inf (no sink) or the SwiGLU unclamped the tokens
    differ, so the comparisons above see both."""
    path, prompts, expected = gpt_oss
    for change in ("sinks", "clamp"):
        llm = LLM(model=str(path), dtype="float32", block_size=4, num_blocks=256)
        for layer in llm.engine.core.model.layers:
            if change == "sinks":
                layer.self_attn.sinks.fill_(float("-inf"))
            else:
                for expert in layer.mlp.experts:
                    expert.spec = dataclasses.replace(expert.spec, swiglu_limit=1e9)
        assert engine_greedy(llm, prompts, NEW_TOKENS) != expected, change


BACKENDS = ["sdpa", pytest.param("cpu-paged", marks=pytest.mark.skipif(
    ggml_kernels() is None, reason="the float32 paged kernel needs AVX2"))]  # fmt: skip


@pytest.mark.parametrize("name", BACKENDS)
def test_sinks_equal_the_reference_softmax_with_a_sink_column(name):
    """A backend's sinks (SDPA: its attention scaled by sigmoid(lse - sink); the paged
    kernel: the sink in the sum where it merges a row's chunks) against the reference
    backend's (a sink column in the softmax): decodes (one over two of the kernel's
    256-key chunks), a prefill over a cached prefix (kernel rows) and a long fresh one
    (SDPA's), windowed and not."""
    for window in (None, 6):
        shapes = [(1, 13), (1, 300), (9, 25), (70, 70)]  # (query, context)
        q, k_cache, v_cache, meta, _ = make_batch(random.Random(3), shapes, 4, 2, 16,
                                                  torch.float32)  # fmt: skip
        sinks = torch.randn(4, generator=torch.Generator().manual_seed(window or 0))
        backend = get_attention_backend(name, 4, 2, window, sinks=True)
        backend.prepare(meta)
        got = backend(q, k_cache, v_cache, meta, 0.25, sinks=sinks)
        want = reference_paged_attention(q, k_cache, v_cache, meta, 0.25, window, sinks)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        plain = reference_paged_attention(q, k_cache, v_cache, meta, 0.25, window)
        assert not torch.allclose(got, plain, atol=1e-3)  # the sinks take their share


def test_a_backend_without_sinks_is_refused(gpt_oss):
    path, _, _ = gpt_oss
    with pytest.raises(ValueError, match="takes no attention sinks"):
        LLM(model=str(path), dtype="float32", num_blocks=32, attention_backend="triton")
