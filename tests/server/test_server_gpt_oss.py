"""A gpt-oss model (attention sinks, sliding and full layers, biased clamped-SwiGLU experts)
behind the real server and the OpenAI SDK: concurrent chats that share a prefix, streamed
and whole alike, a repeat served from the prefix cache with the same answer, every block
back."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.engine.tiny_models import make_tiny_model_dir
from tests.server.conftest import MODEL_NAME, make_engine, running_server

SYSTEM = {"role": "system", "content": "You answer briefly and in plain words. " * 6}
QUESTIONS = ["Name three colours.", "What is two plus two?", "Say hello."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model_dir(tmp_path_factory.mktemp("gpt_oss"), arch="gpt_oss", seed=4)
    with running_server(make_engine(model, num_blocks=128)) as running:
        yield running


def _messages(question: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": question}]


def _chat(server, question: str):
    return server.openai().chat.completions.create(
        model=MODEL_NAME, messages=_messages(question), max_tokens=12, temperature=0
    )


def test_chats_streamed_whole_and_repeated(server):
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: _chat(server, q), QUESTIONS))
    assert all(r.usage.completion_tokens == 12 and r.choices[0].message.content for r in together)
    # Streamed: the same tokens as whole, alone; then again, from the prefix cache.
    whole = _chat(server, QUESTIONS[0])
    stream = server.openai().chat.completions.create(
        model=MODEL_NAME, messages=_messages(QUESTIONS[0]), max_tokens=12, temperature=0,
        stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    again = _chat(server, QUESTIONS[0])
    assert again.choices[0].message.content == whole.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert server.all_blocks_free()
