"""The engine gives the same tokens on any number of torch threads.

The suite runs each pytest worker on its share of the cores (tests/conftest.py: one thread
each on 2 cores), so this is where the kernels' split of rows across threads is checked:
the default model's GGUF blocks through the native kernels and the decode stack, a batch of
prompts of different lengths, greedy, on one thread and on two.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory=128 << 20, seed=0)


def _tokens(llm: LLM, threads: int) -> list[list[int]]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.get_num_threads() == threads
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        torch.set_num_threads(before)
    return [out.token_ids for out in outputs]


def test_two_threads_give_the_tokens_of_one(llm: LLM) -> None:
    one = _tokens(llm, 1)
    assert all(len(tokens) == 24 for tokens in one)
    assert _tokens(llm, 2) == one
