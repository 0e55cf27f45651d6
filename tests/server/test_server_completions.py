"""/v1/completions through the OpenAI SDK against a real server over a tiny random model."""

from __future__ import annotations

import json

from tests.server.conftest import MODEL_NAME, random_ids, sse_payloads

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def greedy_text(client, prompt, max_tokens=6) -> str:
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, **GREEDY)
    return r.choices[0].text


def test_single_prompt_shape_and_usage(server):
    client = server.openai()
    r = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=5, **GREEDY)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL_NAME
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    num_prompt = server.http().post("/tokenize", json={"prompt": "The sky is"}).json()["count"]
    assert r.usage.prompt_tokens == num_prompt
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == num_prompt + 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_list_of_prompts_times_n_orders_choices(server):
    client = server.openai()
    prompts = ["One two three", "Red green blue"]
    r = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, max_tokens=4, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    singles = [greedy_text(client, p, 4) for p in prompts]
    # index = prompt_index * n + i; greedy choices of one prompt are identical.
    assert [c.text for c in r.choices] == [singles[0], singles[0], singles[1], singles[1]]
    assert r.usage.completion_tokens == 16
    assert r.usage.prompt_tokens == sum(
        server.http().post("/tokenize", json={"prompt": p}).json()["count"] for p in prompts
    )


def test_token_id_prompts_match_text_prompts(server):
    client = server.openai()
    texts = ["Once upon a time", "In a galaxy far"]
    ids = [server.http().post("/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    single = client.completions.create(model=MODEL_NAME, prompt=ids[0], max_tokens=5, **GREEDY)
    assert single.choices[0].text == greedy_text(client, texts[0], 5)
    batch = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, **GREEDY)
    assert [c.text for c in batch.choices] == [greedy_text(client, t, 5) for t in texts]


def test_n_with_seed_differs_per_choice_and_reproduces(server):
    client = server.openai()
    kwargs = dict(
        model=MODEL_NAME, prompt="Pick a word:", n=2, max_tokens=8, temperature=1.0, seed=7
    )
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text


def test_seed_reproducibility_at_temperature_one(server):
    client = server.openai()
    kwargs = dict(model=MODEL_NAME, prompt="Random:", max_tokens=8, temperature=1.0)
    first = client.completions.create(seed=1234, **kwargs).choices[0].text
    again = client.completions.create(seed=1234, **kwargs).choices[0].text
    other = client.completions.create(seed=4321, **kwargs).choices[0].text
    assert first == again
    assert first != other


def test_stop_string_truncates_and_reports_stop(server):
    client = server.openai()
    full = greedy_text(client, "Tell me a story", 12)
    # A stop string taken from the middle of the greedy text: generation must end before it.
    middle = len(full) // 2
    stop = full[middle : middle + 3]
    assert stop.strip() and "\ufffd" not in stop, full
    r = client.completions.create(
        model=MODEL_NAME, prompt="Tell me a story", max_tokens=12, stop=[stop], **GREEDY
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]


def test_echo_prepends_prompt_text(server):
    client = server.openai()
    plain = greedy_text(client, "Echo this", 4)
    r = client.completions.create(
        model=MODEL_NAME, prompt="Echo this", max_tokens=4, echo=True, **GREEDY
    )
    assert r.choices[0].text == "Echo this" + plain
    ids = server.http().post("/tokenize", json={"prompt": "Echo this"}).json()["tokens"]
    r = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, echo=True, **GREEDY)
    assert r.choices[0].text == "Echo this" + plain


def test_logprobs_are_consistent_with_greedy_choice(server):
    client = server.openai()
    r = client.completions.create(
        model=MODEL_NAME, prompt="Numbers:", max_tokens=5, logprobs=3, **GREEDY
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and len(top) == 3
        assert abs(logprob - max(top.values())) < 1e-4  # greedy took the most likely token
        assert top[token] == logprob
    offsets = lp.text_offset
    assert offsets[0] == 0
    assert all(offsets[i + 1] - offsets[i] == len(lp.tokens[i]) for i in range(4))


def test_logprobs_zero_lists_just_the_sampled_token(server):
    r = server.openai().completions.create(
        model=MODEL_NAME, prompt="Sampled:", max_tokens=4, logprobs=0, temperature=1.0, seed=5
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs, strict=True)]


def test_echo_with_logprobs_gives_null_prompt_logprobs(server):
    client = server.openai()
    r = client.completions.create(
        model=MODEL_NAME, prompt="Hello world", max_tokens=3, logprobs=1, echo=True, **GREEDY
    )
    lp = r.choices[0].logprobs
    num_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + 3
    assert lp.token_logprobs[:num_prompt] == [None] * num_prompt
    assert all(v is not None for v in lp.token_logprobs[num_prompt:])
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[num_prompt] == len("Hello world")


def test_greedy_stream_joins_to_the_non_streamed_text_with_usage(server):
    client = server.openai()
    kwargs = dict(model=MODEL_NAME, prompt="Streaming test", max_tokens=10, **GREEDY)
    full = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 10
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.id == text_chunks[0].id for c in chunks)


def test_stream_ends_with_done_and_has_no_usage_unless_asked(server):
    body = {"model": MODEL_NAME, "prompt": "Raw stream", "max_tokens": 3, "stream": True,
            "temperature": 0, "n": 2}  # fmt: skip
    with server.http().stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(response.iter_lines())
    assert payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    assert all(e["usage"] is None and len(e["choices"]) == 1 for e in events)
    finished = {e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"]}
    assert finished == {0, 1}


def test_shared_prefix_reports_cached_tokens(server):
    client = server.openai()
    prefix = random_ids(seed=101, n=100)  # 6 full blocks of 16
    first = client.completions.create(model=MODEL_NAME, prompt=prefix, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(
        model=MODEL_NAME, prompt=prefix + random_ids(seed=102, n=10), max_tokens=2, **GREEDY
    )
    assert second.usage.prompt_tokens_details.cached_tokens == 96


def test_cache_salt_isolates_tenants(server):
    client = server.openai()
    prompt = random_ids(seed=201, n=80)  # 5 full blocks

    def cached(salt):
        r = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0,
            extra_body={"cache_salt": salt} if salt else None,
        )  # fmt: skip
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") == 80 - 16  # cached, capped so one prompt token is computed
    assert cached("tenant-b") == 0  # same tokens, other tenant: no sharing
    assert cached(None) == 0


def test_n_sequences_share_the_prompt_blocks(server):
    client = server.openai()
    prompt = random_ids(seed=103, n=64)  # 4 full blocks
    hits_before = server.metric("pagedserve:prefix_cache_hits_total")
    prompt_before = server.metric("pagedserve:prompt_tokens_total")
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, n=4, max_tokens=2, **GREEDY)
    assert len(r.choices) == 4
    # One sequence computes the prompt; the three others find its blocks cached
    # (all but the last block: one prompt token is always computed).
    assert server.metric("pagedserve:prefix_cache_hits_total") - hits_before == 3 * 48
    # prompt_tokens counts every prompt token of every sequence, hits included (vLLM's
    # count): what was computed is that minus the hits.
    prompt_tokens = server.metric("pagedserve:prompt_tokens_total") - prompt_before
    assert prompt_tokens == 4 * 64
    assert prompt_tokens - 3 * 48 == 64 + 3 * 16
