"""Sliding-window models token for token with transformers (float32 greedy), on requests
longer than the window: every layer windowed (Mistral v0.1: one KV cache group), and
windowed layers beside full ones (Qwen2's `max_window_layers`, Gemma 3 one to one and five
to one: hybrid models of two and six groups over one pool), through prefix-cache hits,
chunked prefill and preemption."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.test_engine_golden import (
    assert_all_blocks_free,
    engine_greedy,
    hf_greedy,
    random_prompts,
)
from tests.engine.tiny_models import make_tiny_model_dir

WINDOW = 12
NEW_TOKENS = 20
GEMMA3_5_TO_1 = ["sliding_attention"] * 5 + ["full_attention"]
# name: (transformers' model type, config overrides, the same model with full attention)
MODELS = {
    "mistral": ("mistral", {"sliding_window": WINDOW}, {"sliding_window": None}),
    # layer 0 full, layer 1 sliding
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW,
                        "max_window_layers": 1}, {}),
    "gemma3": ("gemma3_text", {"sliding_window": WINDOW}, {"sliding_window": 4096}),
    "gemma3-5to1": ("gemma3_text", {"sliding_window": WINDOW, "num_hidden_layers": 6,
                                    "layer_types": GEMMA3_5_TO_1},
                    {"sliding_window": 4096, "num_hidden_layers": 6,
                     "layer_types": GEMMA3_5_TO_1}),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(MODELS))
def windowed(request, tmp_path_factory):
    arch, overrides, _ = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_model_dir(path, arch=arch, seed=3, **overrides)
    prompts = random_prompts(seed=5, n=8, vocab=1000, shared_prefix=24)
    return request.param, path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


def test_the_window_changes_transformers_output(windowed, tmp_path):
    """Without this the tests below would pass with the window ignored."""
    name, _, prompts, expected = windowed
    arch, _, full_attention = MODELS[name]
    full = make_tiny_model_dir(tmp_path / "full", arch=arch, seed=3, **full_attention)
    assert hf_greedy(full, prompts, NEW_TOKENS) != expected


def test_windowed_batch_with_hits_matches_transformers(windowed):
    _, path, prompts, expected = windowed
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_blocks=256)
    assert engine_greedy(llm, prompts[:1], NEW_TOKENS) == expected[:1]  # warms the prefix
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
                        use_tqdm=False)  # fmt: skip
    assert [o.token_ids for o in outs] == expected
    assert all(o.num_cached_tokens >= 20 for o in outs[1:])
    assert llm.engine.core.max_model_len > WINDOW  # no longer capped at the window
    assert_all_blocks_free(llm)


# Pools too small for the batch: every request of the all-windowed model holds at most
# window / block_size + 2 blocks of 4 tokens plus its chunk's (8 x 6 > 12), a hybrid one
# also every block of its full layers' group (84 tokens: 21 blocks).
POOL_BLOCKS = {"mistral": 12, "qwen2": 30, "gemma3": 30, "gemma3-5to1": 60}


def test_windowed_preemption_and_chunking_match_transformers(windowed):
    name, path, prompts, expected = windowed
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_blocks=POOL_BLOCKS[name],
              max_num_batched_tokens=10)  # fmt: skip
    assert engine_greedy(llm, prompts, NEW_TOKENS) == expected
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)


def test_a_hybrid_models_groups_share_the_cache_tensors(windowed):
    """Gemma 3's five-to-one layout is six groups of one layer: one K/V tensor pair, shared,
    so a block costs one layer's memory (the budget buys six times the blocks)."""
    name, path, _, _ = windowed
    core = LLM(model=str(path), dtype="float32", block_size=4, num_blocks=64).engine.core
    groups = core.config.kv_cache_groups
    tensors = {caches[0].data_ptr() for caches in core.runner.kv_caches}
    expected = {"mistral": (1, 2), "qwen2": (2, 1), "gemma3": (2, 1), "gemma3-5to1": (6, 1)}
    assert (len(groups), len(tensors)) == expected[name]
    assert core.config.kv_cache_tensors == len(tensors)


# The all-windowed model (one sliding group: its own lookup brings back the window's blocks)
# and the six-group hybrid (each group asked within the others' hit); the two-group models
# add nothing to these.
@pytest.mark.parametrize("windowed", ["mistral", "gemma3-5to1"], indirect=True)
def test_windowed_blocks_come_back_from_the_tier_with_transformers_tokens(windowed, tmp_path):
    """A second tier serves every group: a repeat finds what the small pool evicted (the
    window's last blocks too) in the tier, and the tokens stay transformers'."""
    name, path, prompts, expected = windowed
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_blocks=POOL_BLOCKS[name],
              max_num_batched_tokens=10, kv_offload_bytes=4 << 20, cache_dir=str(tmp_path))  # fmt: skip
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    for _ in range(2):  # each prompt alone: it evicts the ones before
        for prompt, tokens in zip(prompts[:4], expected[:4], strict=True):
            (out,) = llm.generate([prompt], params, use_tqdm=False)
            assert out.token_ids == tokens
    kv = llm.engine.core.kv_cache_manager
    assert kv.stats.tier_hits > 0
    assert_all_blocks_free(llm)
