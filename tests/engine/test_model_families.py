"""The families of issue 62 (Qwen3, Gemma 3's text model, SmolLM3, Phi-3 / Phi-4-mini) on
the shared blocks: greedy tokens equal transformers' `generate(do_sample=False)` in float32
for a batch, also through prefix-cache hits, chunked prefill and preemption (a tiny KV pool
and token budget), on two-layer random-weight models (tests/engine/tiny_models.py).

Every sequence here stays shorter than Gemma 3's tiny `sliding_window` (128) and Phi-3's
`original_max_position_embeddings` (128): the window is the attention backends' (its own
tests), the long rope factors are checked against transformers' table directly.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.execution_plan import ModelShape
from engine.loader import load_hf_config
from engine.models import get_model_class
from engine.models.rotary import RotaryEmbedding
from tests.engine.test_engine_golden import (
    assert_all_blocks_free,
    engine_greedy,
    hf_greedy,
    random_prompts,
)
from tests.engine.tiny_models import make_tiny_model_dir

FAMILIES = ["qwen3", "gemma3_text", "smollm3", "phi3"]
NEW_TOKENS = 16


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), arch=request.param, seed=1)


def test_the_architecture_is_served(family_model):
    config = load_hf_config(family_model)  # the refusal of an unsupported architecture is gone
    assert get_model_class(config).__name__ == config.architectures[0]


def test_batch_with_prefix_hits_matches_transformers(family_model):
    prompts = random_prompts(seed=11, n=4, vocab=1000, shared_prefix=40)
    expected = hf_greedy(family_model, prompts, NEW_TOKENS)
    llm = LLM(model=str(family_model), dtype="float32", block_size=8, num_blocks=128)
    assert engine_greedy(llm, prompts[:1], NEW_TOKENS) == expected[:1]  # warms the cache
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), use_tqdm=False
    )
    assert [o.token_ids for o in outs] == expected
    assert all(o.num_cached_tokens >= 40 for o in outs)
    assert_all_blocks_free(llm)


def test_chunked_prefill_and_preemption_match_transformers(family_model):
    prompts = random_prompts(seed=13, n=6, vocab=1000, shared_prefix=16)
    expected = hf_greedy(family_model, prompts, NEW_TOKENS)
    # 26 blocks a KV cache group (Gemma 3's sliding and full layers are two groups)
    config = load_hf_config(family_model)
    groups = len(set(get_model_class(config).architecture(config).layer_types))
    llm = LLM(model=str(family_model), dtype="float32", block_size=4, num_blocks=26 * groups,
              max_num_batched_tokens=12)  # fmt: skip
    assert engine_greedy(llm, prompts, NEW_TOKENS) == expected
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert llm.engine.core.kv_cache_manager.stats.hits > 0
    assert_all_blocks_free(llm)


def test_what_each_family_keeps_from_the_native_paths(family_model):
    """The native layer ops compute Llama's norms and full-width rotary (q/k norms run in
    torch before them; a NoPE layer rotates by angle 0); the decode stack Llama's layer,
    Qwen3's q/k norms and partial rotary."""
    config = load_hf_config(family_model)
    shape = ModelShape.of(config)
    expected = {
        "qwen3": (None, None),
        "gemma3_text": ("(1 + w) norms, sandwich norms, gelu_pytorch_tanh MLP", "sliding window"),
        "smollm3": (None, "per-layer rotary"),
        "phi3": ("partial rotary", None),  # (the stack's rotary is partial too: Qwen3.5's)
    }[config.model_type]
    assert shape.layer_ops_misfit == expected[0]
    if expected[1] is None:
        assert shape.decode_stack_misfit is None
    else:
        assert expected[1] in shape.decode_stack_misfit


def test_sliding_layers_carry_their_window(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "gemma", arch="gemma3_text", seed=1)
    llm = LLM(model=str(model_dir), dtype="float32", num_blocks=16)
    model = llm.engine.core.runner.model
    assert [layer.self_attn.sliding_window for layer in model.layers] == [128, None]
    assert model.arch.layer_types == ("sliding_attention", "full_attention")


def test_longrope_table_is_transformers_past_the_original_length(tmp_path):
    """Below original_max_position_embeddings the short factors, from it on the long ones,
    each row as transformers' Phi-3 rotary computes that position."""
    from engine.loader import load_reference_model

    model_dir = make_tiny_model_dir(tmp_path / "phi3", arch="phi3", seed=1,
                                    original_max_position_embeddings=32,
                                    rope_parameters={
                                        "rope_type": "longrope", "rope_theta": 10000.0,
                                        "partial_rotary_factor": 0.75,
                                        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                        "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
                                        "original_max_position_embeddings": 32})  # fmt: skip
    hf = load_reference_model(model_dir, torch.float32)
    ours = RotaryEmbedding(load_hf_config(model_dir), 16, 64, torch.float32, "cpu")
    assert ours.cos.shape == (64, 12)  # rotary on 3/4 of the head
    x = torch.zeros(1)
    for position in (0, 31, 32, 63):
        cos, sin = hf.model.rotary_emb(x, torch.tensor([[position]]))
        assert torch.equal(cos[0, 0], ours.cos[position]), position
        assert torch.equal(sin[0, 0], ours.sin[position]), position
