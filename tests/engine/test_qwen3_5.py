"""Qwen3.5 (Gated DeltaNet layers beside gated full attention) token for token with
transformers (float32 greedy): batched, prefilled in chunks of any size with snapshots
inside them, resumed from a prefix-cache snapshot, through preemption; and every state slot
and block back at the end."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from tests.engine.test_engine_golden import engine_greedy, hf_greedy, random_prompts
from tests.engine.test_speculative import OracleDrafter, spec_counts
from tests.engine.tiny_models import make_tiny_model_dir

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("qwen3_5"), arch="qwen3_5_text", seed=3)
    # A shared prefix of 30 tokens (7 blocks of 4 and 2 tokens), then 3 to 40 of their own.
    prompts = random_prompts(seed=5, n=4, vocab=1000, shared_prefix=30)
    return path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


def assert_all_free(llm: LLM) -> None:
    kv = llm.engine.core.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == llm.engine.core.num_blocks
    assert kv.state.num_slots_in_use == 0


def test_batch_and_a_repeat_resumed_from_snapshots_match_transformers(qwen3_5):
    path, prompts, expected = qwen3_5
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_blocks=256,
              state_slots=32, state_snapshot_interval=2)  # fmt: skip
    assert engine_greedy(llm, prompts, NEW_TOKENS) == expected
    # Again: each prompt's state resumes from the snapshot at its last block boundary.
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.num_cached_tokens == (len(prompt) - 1) // 4 * 4
    assert_all_free(llm)


def test_a_new_prompt_resumes_from_the_last_snapshot_of_a_shared_prefix(qwen3_5):
    path, prompts, expected = qwen3_5
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_blocks=256,
              state_slots=32, state_snapshot_interval=2)  # fmt: skip
    assert engine_greedy(llm, prompts[:1], NEW_TOKENS) == expected[:1]
    outs = llm.generate(prompts[1:], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
                        use_tqdm=False)  # fmt: skip
    assert [o.token_ids for o in outs] == expected[1:]
    # The 30 shared tokens: the first resumes from the snapshot every 2 blocks at 24 tokens
    # and snapshots where the KV cache's share ends (28: 7 blocks); the others wait a step
    # for that one and resume from it.
    assert [o.num_cached_tokens for o in outs] == [24, 28, 28]
    assert_all_free(llm)


@pytest.mark.parametrize("chunk", [5, 13])
def test_chunked_prefill_with_snapshots_inside_chunks_matches_transformers(qwen3_5, chunk):
    path, prompts, expected = qwen3_5
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_blocks=256,
              max_num_batched_tokens=chunk, state_slots=32, state_snapshot_interval=1)  # fmt: skip
    assert engine_greedy(llm, prompts, NEW_TOKENS) == expected
    assert_all_free(llm)


def test_preemption_and_few_state_slots_match_transformers(qwen3_5):
    path, prompts, expected = qwen3_5
    # 3 slots: no more than 3 requests run at once, snapshots take what is left; 40 blocks
    # of 4 tokens cannot hold every request's 40-86 tokens at once: preemption.
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_blocks=40, state_slots=3,
              max_num_batched_tokens=16)  # fmt: skip
    assert engine_greedy(llm, prompts, NEW_TOKENS) == expected
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_all_free(llm)


def test_evicted_blocks_and_snapshots_come_back_from_the_tier_and_a_restart(qwen3_5, tmp_path):
    """With a second tier, what the pools evict (KV blocks in one file, state snapshots in
    another) comes back on a hit, bit for bit: the tokens stay transformers'; a restarted
    engine resumes a repeated prompt from the tier's snapshot."""
    path, prompts, expected = qwen3_5

    def make() -> LLM:  # 40 blocks and 4 slots: each prompt evicts the one before
        return LLM(model=str(path), dtype="float32", block_size=4, num_blocks=40, state_slots=4,
                   state_snapshot_interval=2, kv_offload_bytes=8 << 20, cache_dir=str(tmp_path))  # fmt: skip

    def one(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
                              use_tqdm=False)  # fmt: skip
        return out.token_ids, out.num_cached_tokens

    llm = make()
    kv = llm.engine.core.kv_cache_manager
    assert kv.tier is not None and kv.state_tier is not None
    for prompt, tokens in zip(prompts, expected, strict=True):
        assert one(llm, prompt)[0] == tokens
    assert len(kv.tier) > 0 and len(kv.state_tier) > 0  # each pool evicted into its tier
    for prompt, tokens in zip(prompts, expected, strict=True):
        assert one(llm, prompt) == (tokens, (len(prompt) - 1) // 4 * 4)
    assert kv.stats.tier_hits > 0
    assert_all_free(llm)
    llm.engine.shutdown()  # saves what the pools cache to the tiers
    again = make()
    kv = again.engine.core.kv_cache_manager
    assert kv.tier.reopened_entries > 0 and kv.state_tier.reopened_entries > 0
    assert one(again, prompts[0]) == (expected[0], (len(prompts[0]) - 1) // 4 * 4)


def test_speculation_rolls_the_state_back_past_rejected_drafts(qwen3_5):
    """Drafts from the true output, often corrupted: every outcome (all kept, some, none)
    happens, and a rejected draft's state change is undone (the next step resumes from
    the state after the last kept token)."""
    path, prompts, expected = qwen3_5
    on = LLM(model=str(path), dtype="float32", block_size=4, num_blocks=256, state_slots=32,
             speculative="ngram", num_speculative_tokens=4)  # fmt: skip
    truth = {tuple(p): e for p, e in zip(prompts, expected, strict=True)}
    on.engine.core.speculator.drafter = OracleDrafter(truth)
    assert engine_greedy(on, prompts, NEW_TOKENS) == expected
    drafted, kept = spec_counts(on)
    assert kept >= 10 and drafted > kept  # drafts kept, and some rejected
    assert_all_free(on)


def test_a_multimodal_checkpoint_serves_its_text_model(qwen3_5, tmp_path):
    """Qwen3.5's releases are Qwen3_5ForConditionalGeneration: the text model's config under
    text_config, its weights under model.language_model., a vision tower and multi-token
    prediction weights beside them (neither read)."""
    path, prompts, expected = qwen3_5
    wrapped = tmp_path / "wrapped"
    shutil.copytree(path, wrapped)
    config = json.loads((path / "config.json").read_text())
    (wrapped / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": config, "tie_word_embeddings": False,
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1},
    }))  # fmt: skip
    tensors = load_file(path / "model.safetensors")
    renamed = {("model.language_model." + k[len("model."):]) if k.startswith("model.") else k: v
               for k, v in tensors.items()}  # fmt: skip
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3)
    renamed["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(renamed, wrapped / "model.safetensors")
    llm = LLM(model=str(wrapped), dtype="float32", block_size=4, num_blocks=256)
    assert engine_greedy(llm, prompts[:2], NEW_TOKENS) == expected[:2]
