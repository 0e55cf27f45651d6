"""End to end on the embedded default model (SmolLM2-135M-Instruct): token-exact with transformers."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.loader import resolve_model_dir
from tests.engine.test_engine_golden import assert_all_blocks_free, hf_greedy
from tests.engine.tiny_models import default_reference_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a KV cache is in one sentence.",
]


@pytest.fixture(scope="module")
def default_llm():
    return LLM(dtype="float32", max_model_len=2048)


def test_default_model_chat_matches_transformers(default_llm):
    prompts = [default_llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    expected = hf_greedy(resolve_model_dir(None), prompts, 32, default_reference_model())
    outs = default_llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
    assert [o.token_ids for o in outs] == expected
    assert "Paris" in outs[0].text
    assert_all_blocks_free(default_llm)
