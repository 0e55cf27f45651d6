"""Tensor parallelism over torch.distributed (gloo on CPU): two processes, a tiny model
with an even number of query and KV heads, greedy tokens equal to one process's in fp32,
through prefix-cache hits and preemption."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.tiny_models import make_tiny_model_dir

PREFIX = list(range(200, 248))  # 3 blocks every request shares
# 16 blocks of 16 tokens: 4 requests of 58-token prompts growing by 40 do not fit at once.
ENGINE = {"dtype": "float32", "device": "cpu", "num_blocks": 16, "block_size": 16, "seed": 0,
          "max_num_seqs": 4}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tp-model"))


def run(model_dir, tensor_parallel_size: int) -> tuple[dict[str, list[int]], LLMEngine]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), tensor_parallel_size=tensor_parallel_size,
                                    **ENGINE))  # fmt: skip
    try:
        outputs: dict[str, list[int]] = {}
        for wave in range(2):  # the second wave finds the prefix cached by the first
            for i in range(4):
                prompt = PREFIX + [300 + 10 * wave + i] * 10
                params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
                engine.add_request(f"w{wave}-{i}", prompt, params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        outputs[out.request_id] = out.token_ids
    finally:
        engine.shutdown()
    return outputs, engine


def test_two_ranks_give_one_ranks_greedy_tokens_through_hits_and_preemption(model_dir):
    single, one = run(model_dir, 1)
    split, two = run(model_dir, 2)
    assert split == single
    for engine in (one, two):
        assert engine.core.scheduler.num_preemptions > 0
        assert engine.core.kv_cache_manager.stats.hits > 0
    # Each rank holds half the KV heads: rank 0's cache is half the single process's.
    assert two.core.model.num_kv_heads * 2 == one.core.model.num_kv_heads
    assert two.core.runner.kv_caches[0][0].shape[2] == one.core.runner.kv_caches[0][0].shape[2] // 2


def test_a_size_that_does_not_divide_the_heads_is_refused(model_dir):
    with pytest.raises(
        ValueError, match="tensor_parallel_size 3 does not divide num_attention_heads"
    ):
        LLMEngine(EngineConfig(model=str(model_dir), tensor_parallel_size=3, **ENGINE))
