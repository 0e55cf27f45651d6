"""A Qwen3.5 model (linear-attention layers keeping a state per request) behind the real
server and the OpenAI SDK: a repeated conversation resumes from a snapshot of its state
(cached tokens in the usage), /metrics shows the state slots, and every slot comes back
however a request ends (finished, or its client gone mid-stream)."""

from __future__ import annotations

import time

import pytest

from tests.engine.tiny_models import make_tiny_model_dir
from tests.server.conftest import MODEL_NAME, make_engine, running_server

MESSAGES = [{"role": "system", "content": "You answer briefly. " * 8},
            {"role": "user", "content": "Name three colours of the rainbow, please."}]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model_dir(tmp_path_factory.mktemp("qwen3_5"), arch="qwen3_5_text", seed=3)
    with running_server(make_engine(model, num_blocks=128, state_slots=16)) as running:
        yield running


def slots(server) -> dict[str, float]:
    return {state: server.metric("pagedserve:state_slots", state=state)
            for state in ("free", "cached", "in_use")}  # fmt: skip


def wait_all_free(server) -> None:
    deadline = time.monotonic() + 10
    while not (server.all_blocks_free() and slots(server)["in_use"] == 0):
        assert time.monotonic() < deadline, slots(server)
        time.sleep(0.05)


def test_a_repeated_chat_resumes_from_a_snapshot_of_its_state(server):
    client = server.openai()
    first = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8,
                                           temperature=0)  # fmt: skip
    again = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8,
                                           temperature=0)  # fmt: skip
    assert again.choices[0].message.content == first.choices[0].message.content
    prompt = again.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == (prompt - 1) // 16 * 16 > 0
    wait_all_free(server)
    counts = slots(server)
    assert counts["cached"] > 0 and counts["in_use"] == 0 and sum(counts.values()) == 16


def test_a_stream_its_client_leaves_gives_its_state_back(server):
    client = server.openai()
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True,
                                            max_tokens=200, temperature=0.7)  # fmt: skip
    next(iter(stream))
    stream.close()
    wait_all_free(server)


def test_n_choices_each_get_a_state_forked_from_the_prompts(server):
    """n > 1: a request per choice, each with its own live slot; the choices after the
    first resume from the prompt's snapshot the first writes (a step later)."""
    client = server.openai()
    messages = [{"role": "user", "content": "Write a short poem about the sea and the sky."}]
    greedy = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6,
                                            temperature=0, n=3)  # fmt: skip
    texts = [c.message.content for c in greedy.choices]
    assert len(texts) == 3 and len(set(texts)) == 1  # the same state, the same tokens
    wait_all_free(server)
