"""vLLM's `return_tokens_as_token_ids`: logprobs name each token "token_id:<id>" (issue 63's
check that a request gives the same tokens), on completions and chat, whole and streamed,
n > 1, echo; and `serve --return-tokens-as-token-ids`, which a request's own field overrides.

The ids are checked against the tokenizer's: the echoed prompt's against /tokenize, each
generated id's text against the token the same request names by text, and all the ids
together against the choice's text through /detokenize."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import MODEL_NAME, RunningServer, make_engine, running_server

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "Name three colors."}]
# n = 2 seeded: two different choices, the same ones on every request.
SAMPLED: dict[str, Any] = {"model": MODEL, "n": 2, "seed": 11, "temperature": 0.8, "max_tokens": 6}
AS_IDS = {"return_tokens_as_token_ids": True}
TOKEN_ID = re.compile(r"token_id:([0-9]+)")


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    engine = make_engine(None, num_blocks=128, max_model_len=2048)  # model=None: the default
    with running_server(engine, served_model_name=None) as s:
        yield s


def ids_of(tokens: list[str]) -> list[int]:
    """The ids of "token_id:<id>" strings; fails on any other string."""
    matches = [TOKEN_ID.fullmatch(t) for t in tokens]
    assert all(matches), tokens
    return [int(m.group(1)) for m in matches if m]


def detokenize(server: RunningServer, ids: list[int]) -> str:
    response = server.http().post("/detokenize", json={"tokens": ids})
    assert response.status_code == 200, response.text
    return response.json()["prompt"]


def tokenize(server: RunningServer, prompt: str) -> list[int]:
    return server.http().post("/tokenize", json={"prompt": prompt}).json()["tokens"]


# --------------------------------------------------------------------------- completions


def test_completions_name_every_token_by_its_id_the_tokenizers(server):
    client = server.openai()
    ask = {**SAMPLED, "prompt": PROMPT, "logprobs": 2, "echo": True}
    by_id = client.completions.create(**ask, extra_body=AS_IDS)
    by_text = client.completions.create(**ask)  # the same tokens (seeded), named by text
    prompt_ids = tokenize(server, PROMPT)
    assert len(by_id.choices) == 2 and by_id.choices[0].text != by_id.choices[1].text
    for mine, plain in zip(by_id.choices, by_text.choices, strict=True):
        lp = mine.logprobs
        ids = ids_of(lp.tokens)
        assert ids[: len(prompt_ids)] == prompt_ids  # the echoed prompt: the tokenizer's ids
        assert mine.finish_reason == "length" and detokenize(server, ids) == mine.text
        # The engine's tokens: each id's text is the token the plain request names.
        assert [detokenize(server, [i]) for i in ids] == plain.logprobs.tokens
        assert lp.text_offset == plain.logprobs.text_offset  # offsets still index `text`
        start = len(prompt_ids)  # the generated tokens', which have top_logprobs
        for token, top in zip(lp.tokens[start:], lp.top_logprobs[start:], strict=True):
            assert token in top and ids_of(list(top))


def test_completions_stream_names_tokens_by_id_in_every_chunk(server):
    client = server.openai()
    ask = {**SAMPLED, "prompt": PROMPT, "logprobs": 1}
    whole = client.completions.create(**ask, extra_body=AS_IDS)
    tokens: dict[int, list[str]] = defaultdict(list)
    texts: dict[int, str] = defaultdict(str)
    for chunk in client.completions.create(**ask, stream=True, extra_body=AS_IDS):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.logprobs:
                tokens[choice.index] += choice.logprobs.tokens
                assert all(ids_of(list(top)) for top in choice.logprobs.top_logprobs)
    for choice in whole.choices:
        ids = ids_of(tokens[choice.index])
        assert ids == ids_of(choice.logprobs.tokens)
        assert detokenize(server, ids) == texts[choice.index] == choice.text


def test_the_field_without_logprobs_is_accepted_and_has_nothing_to_rename(server):
    r = server.openai().completions.create(**SAMPLED, prompt=PROMPT, extra_body=AS_IDS)
    assert all(c.logprobs is None and c.text for c in r.choices)


# -------------------------------------------------------------------------------- chat


def test_chat_names_tokens_by_id_with_vllms_bytes(server):
    client = server.openai()
    ask = {**SAMPLED, "messages": MESSAGES, "logprobs": True, "top_logprobs": 2}
    by_id = client.chat.completions.create(**ask, extra_body=AS_IDS)
    by_text = client.chat.completions.create(**ask)
    assert len(by_id.choices) == 2
    for mine, plain in zip(by_id.choices, by_text.choices, strict=True):
        content, plain_content = mine.logprobs.content, plain.logprobs.content
        ids = ids_of([t.token for t in content])
        assert [detokenize(server, [i]) for i in ids] == [t.token for t in plain_content]
        assert mine.finish_reason == "length"
        assert detokenize(server, ids) == mine.message.content
        # The chosen token keeps its own bytes; they join to the text.
        assert [t.bytes for t in content] == [t.bytes for t in plain_content]
        assert bytes(b for t in content for b in t.bytes).decode() == mine.message.content
        for item in content:
            top_ids = ids_of([t.token for t in item.top_logprobs])
            assert len(top_ids) == 2
            # vLLM's: a top entry's bytes are those of the "token_id:<id>" string it shows.
            assert [t.bytes for t in item.top_logprobs] == [
                list(f"token_id:{i}".encode()) for i in top_ids
            ]


def test_chat_stream_names_tokens_by_id_in_every_chunk(server):
    client = server.openai()
    ask = {**SAMPLED, "messages": MESSAGES, "logprobs": True, "top_logprobs": 1}
    whole = client.chat.completions.create(**ask, extra_body=AS_IDS)
    tokens: dict[int, list[str]] = defaultdict(list)
    for chunk in client.chat.completions.create(**ask, stream=True, extra_body=AS_IDS):
        for choice in chunk.choices:
            for item in (choice.logprobs and choice.logprobs.content) or []:
                tokens[choice.index].append(item.token)
                assert ids_of([t.token for t in item.top_logprobs])
    for choice in whole.choices:
        ids = ids_of(tokens[choice.index])
        assert ids == ids_of([t.token for t in choice.logprobs.content])
        assert detokenize(server, ids) == choice.message.content


# ------------------------------------------------------------------------ the server flag


def test_the_server_flag_names_tokens_by_id_unless_a_request_says_false(tiny_model_dir: Path):
    engine = make_engine(tiny_model_dir)
    with running_server(engine, return_tokens_as_token_ids=True) as tiny:
        client = tiny.openai()
        ask = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3, "logprobs": 1,
               "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
        flagged = client.completions.create(**ask).choices[0].logprobs.tokens
        assert len(ids_of(flagged)) == 3
        chat = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=2, logprobs=True, temperature=0
        )
        assert ids_of([t.token for t in chat.choices[0].logprobs.content])
        ask["extra_body"] = {"ignore_eos": True, "return_tokens_as_token_ids": False}
        texts = client.completions.create(**ask).choices[0].logprobs.tokens
        tokenizer = engine.core.tokenizer
        assert texts == [tokenizer.decode([i], skip_special_tokens=False) for i in ids_of(flagged)]
