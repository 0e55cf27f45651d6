"""The server with `--speculative ngram` on the default model, through the OpenAI SDK.

A chat that asks the model to copy a text back makes the drafter propose; every answer
must equal the same request with speculation turned off for it (`speculative: false`),
streamed or not, with stop strings, logprobs and n > 1; /metrics counts the drafts.
"""

from __future__ import annotations

import time

import pytest

from tests.server.conftest import MODEL_NAME, make_engine, running_server

TEXT = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n"
)
MESSAGES = [{"role": "user", "content": f"Repeat this code exactly:\n{TEXT}"}]


@pytest.fixture(scope="module")
def server():
    with running_server(make_engine(None, speculative="ngram")) as running:
        yield running


def chat(server, stream: bool = False, **options):
    client = server.openai()
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 40, "temperature": 0,
            **options}  # fmt: skip
    if not stream:
        out = client.chat.completions.create(**body)
        return [c.message.content for c in out.choices], out
    chunks = list(client.chat.completions.create(stream=True, **body))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    return [texts[i] for i in sorted(texts)], chunks


def spec_metrics(server) -> tuple[float, float]:
    """Draft tokens verified and kept so far, once the engine has finished every request
    (a stop string's request may take one more step after its answer went out)."""
    deadline = time.monotonic() + 30
    while server.engine.core.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # the last step's stats reach /metrics after it
    m = server.metrics()
    return (m[("pagedserve:spec_decode_num_draft_tokens_total", ())],
            m[("pagedserve:spec_decode_num_accepted_tokens_total", ())])  # fmt: skip


@pytest.mark.parametrize(
    ("stream", "options"),
    [(False, {}), (False, {"stop": ["perimeter"]}),
     (True, {"n": 2, "temperature": 0.8, "seed": 5})],
    ids=["greedy", "stop-string", "streamed-n2-seeded"],
)  # fmt: skip
def test_answers_equal_the_same_request_without_speculation(server, options, stream):
    drafted, kept = spec_metrics(server)
    got, _ = chat(server, stream, **options)
    now_drafted, now_kept = spec_metrics(server)
    assert now_kept - kept >= 5, "no draft kept: the case tests nothing"
    want, _ = chat(server, stream, extra_body={"speculative": False}, **options)
    assert spec_metrics(server)[0] == now_drafted  # the opt-out drafted nothing
    assert got == want
    if "stop" in options:
        assert all("perimeter" not in text for text in got)


def test_logprobs_come_one_per_token_with_speculation(server):
    _, out = chat(server, logprobs=True, top_logprobs=2)
    _, plain = chat(server, logprobs=True, top_logprobs=2, extra_body={"speculative": False})
    got = [(t.token, len(t.top_logprobs)) for t in out.choices[0].logprobs.content]
    assert got == [(t.token, len(t.top_logprobs)) for t in plain.choices[0].logprobs.content]
    assert len(got) == out.usage.completion_tokens


def test_a_wrong_type_for_the_opt_out_is_a_400(server):
    with server.http() as http:
        body = {"model": MODEL_NAME, "messages": MESSAGES, "speculative": {"no": 1}}
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert "speculative" in response.text
