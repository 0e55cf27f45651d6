"""A Qwen3-MoE model (a mixture of experts) behind the real server and the OpenAI SDK:
concurrent streams that share a prefix, each chat the same answer alone and beside the
others at temperature 0, a repeat served from the prefix cache, every block back."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.engine.tiny_models import make_tiny_model_dir
from tests.server.conftest import MODEL_NAME, make_engine, running_server

SYSTEM = {"role": "system", "content": "You answer briefly and in plain words. " * 6}
QUESTIONS = ["Name three colours.", "What is two plus two?", "Say hello.", "Count to five."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model_dir(tmp_path_factory.mktemp("qwen3_moe"), arch="qwen3_moe", seed=3)
    with running_server(make_engine(model, num_blocks=128)) as running:
        yield running


def _chat(server, question: str):
    return server.openai().chat.completions.create(
        model=MODEL_NAME, messages=[SYSTEM, {"role": "user", "content": question}],
        max_tokens=12, temperature=0,
    )  # fmt: skip


def test_concurrent_chats_sharing_a_prefix(server):
    alone = [_chat(server, q).choices[0].message.content for q in QUESTIONS]
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: _chat(server, q), QUESTIONS))
    # (float32 weights: the grouped experts give each row the same sums in any batch here)
    assert [r.choices[0].message.content for r in together] == alone
    assert all(r.usage.prompt_tokens_details.cached_tokens > 0 for r in together)
    assert server.all_blocks_free()
