"""/v1/chat/completions, streaming and not, through the OpenAI SDK."""

from __future__ import annotations

from tests.server.conftest import MODEL_NAME

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something."},
]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def test_chat_completion_shape_and_usage(server):
    client = server.openai()
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, **GREEDY)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL_NAME
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason == "length"
    templated = server.http().post("/tokenize", json={"messages": MESSAGES}).json()
    assert r.usage.prompt_tokens == templated["count"]
    assert r.usage.completion_tokens == 6 and r.usage.total_tokens == templated["count"] + 6


def test_chat_prompt_is_the_chat_template_with_generation_prompt(server):
    # The same ids sent as a completion prompt give the same greedy text.
    client = server.openai()
    ids = server.http().post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    text = server.engine.core.tokenizer.decode(ids)
    assert text.rstrip().endswith("assistant")  # SmolLM2: "<|im_start|>assistant\n"
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=6, **GREEDY
    )
    completion = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, **GREEDY)
    assert chat.choices[0].message.content == completion.choices[0].text


def test_chat_stream_role_first_then_content_then_usage(server):
    client = server.openai()
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, **GREEDY)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    assert all(c.object == "chat.completion.chunk" and c.id.startswith("chatcmpl-") for c in chunks)
    first, content, usage = chunks[0], chunks[1:-1], chunks[-1]
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in content) == full
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert usage.choices == [] and usage.usage.completion_tokens == 8


def test_chat_n_choices_and_stop(server):
    client = server.openai()
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=5, n=3, temperature=1.0, seed=3
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # seed + i per choice
    full = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=10, **GREEDY
    )
    text = full.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip() and "\ufffd" not in stop, text
    stopped = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=10, stop=stop, **GREEDY
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(stop)]


def test_chat_logprobs_format(server):
    client = server.openai()
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    joined = b"".join(bytes(item.bytes) for item in content).decode("utf-8", errors="replace")
    assert joined == r.choices[0].message.content
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert abs(item.logprob - item.top_logprobs[0].logprob) < 1e-4  # greedy: the top token
        assert item.top_logprobs[0].token == item.token


def test_chat_stream_logprobs_cover_every_token(server):
    client = server.openai()
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=6, logprobs=True, stream=True, **GREEDY
        )
    )
    items = [
        item for c in chunks[1:] if c.choices[0].logprobs for item in c.choices[0].logprobs.content
    ]
    assert len(items) == 6
    assert "".join(i.token for i in items) == "".join(
        c.choices[0].delta.content or "" for c in chunks
    )


def test_a_thinking_budget_on_a_model_without_think_blocks_is_a_400(server):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, "thinking_token_budget": 2}  # fmt: skip
    response = server.http().post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "thinking_token_budget" and "--reasoning-parser" in error["message"]
