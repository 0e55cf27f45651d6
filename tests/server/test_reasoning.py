"""Reasoning separation (server/reasoning.py): the splitter on its own, whole and streamed
at every chunk size, and through the server on a tiny random model whose output is forced
(a one-string guided_choice) to a think block and an answer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest

from server.reasoning import (
    ReasoningSplitter,
    reasoning_mode,
    resolve_parser,
    split_reasoning,
)
from server.server_config import ServerConfig
from tests.engine.tiny_models import make_tiny_model_dir
from tests.server.conftest import MODEL_NAME, RunningServer, make_engine, running_server

CASES = [
    # (output, prompt opened the block, reasoning, content)
    ("<think>\nA plan.\n</think>\n\nParis.", False, "\nA plan.\n", "Paris."),
    ("  <think>x</think>y", False, "x", "y"),
    ("<think></think>Hi", False, "", "Hi"),
    ("Plain <think> text", False, None, "Plain <think> text"),
    ("<thi", False, None, "<thi"),
    ("<think>never closed", False, "never closed", ""),
    ("just an answer", False, None, "just an answer"),
    ("A plan.</think>\nParis.", True, "A plan.", "Paris."),
    ("still thinking", True, "still thinking", ""),
    ("a < b </thin", True, "a < b </thin", ""),
]


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), CASES)
def test_the_splitter_gives_the_same_split_whole_or_in_any_chunks(text, opened, reasoning, content):
    assert split_reasoning(text, ReasoningSplitter(opened)) == (reasoning, content)
    for size in range(1, len(text) + 1):
        splitter, got_reasoning, got_content = ReasoningSplitter(opened), "", ""
        for start in range(0, len(text), size):
            r, c = splitter.feed(text[start : start + size])
            got_reasoning, got_content = got_reasoning + r, got_content + c
        r, c = splitter.finish()
        assert (got_reasoning + r, got_content + c) == (reasoning or "", content), size


def test_auto_picks_think_where_the_template_names_it():
    assert resolve_parser("auto", "{{ '<think>' }}") == "think"
    assert resolve_parser("auto", "{{ messages }}") == "none"
    # DeepSeek-R1's template names only the closing tag, to strip earlier turns' thinking.
    assert resolve_parser("auto", "{% if '</think>' in content %}") == "think"
    assert resolve_parser("none", "<think>") == "none"
    assert resolve_parser("think", None) == "think"
    assert reasoning_mode("think", "<|im_start|>assistant\n<think>\n").opened
    assert not reasoning_mode("think", "<|im_start|>assistant\n").opened
    assert not reasoning_mode("none", "<think>").enabled


@pytest.mark.parametrize("value", ["bogus", "", 3, None])
def test_a_bad_reasoning_parser_flag_is_refused_at_start_up(value):
    with pytest.raises(ValueError, match="reasoning"):
        ServerConfig(reasoning_parser=value)


# ----------------------------------------------------------------------- through the server

# The generation prompt opens the think block, as Qwen3's and DeepSeek-R1's templates do;
# naming <think> makes --reasoning-parser's default ("auto") pick the think parser.
TEMPLATE = """{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""
OUTPUT = "<think>\nThe user asks for a capital.\n</think>\n\nParis."
REASONING, ANSWER = "\nThe user asks for a capital.\n", "Paris."
ASK = [{"role": "user", "content": "Capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[RunningServer]:
    path = make_tiny_model_dir(tmp_path_factory.mktemp("reasoning-model"))
    Path(path, "chat_template.jinja").write_text(TEMPLATE)
    with running_server(make_engine(path)) as s:  # --reasoning-parser auto
        yield s


def test_chat_puts_the_think_block_in_reasoning_content_whole_and_streamed(server):
    """Forced to a whole think block and an answer (a constrained output starts outside
    the block the prompt opened: the grammar's text is the output's first token on)."""
    client = server.openai()
    args = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 60,
            "extra_body": {"guided_choice": [OUTPUT]}}  # fmt: skip
    message = client.chat.completions.create(**args).choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, ANSWER)
    reasoning, content, order = "", "", []
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            order += [k for k in ("reasoning_content", "content") if delta.get(k)]
    assert (reasoning, content) == (REASONING, ANSWER)
    assert order.index("content") > max(i for i, k in enumerate(order) if k == "reasoning_content")


def test_an_answer_without_a_think_block_has_no_reasoning_field(server):
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 20,
            "guided_choice": ["No thoughts."]}  # fmt: skip
    message = server.http().post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["content"] == "No thoughts." and "reasoning_content" not in message


def test_unconstrained_output_after_an_opened_block_is_reasoning(server):
    message = (
        server.openai()
        .chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=8, temperature=0)
        .choices[0]
        .message
    )
    assert message.reasoning_content and not message.content


def test_messages_gives_thinking_blocks_whole_and_streamed(server):
    """The random model never closes the block the prompt opened: all its text is thinking."""
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                                 timeout=60)  # fmt: skip
    args = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 8,
            "extra_body": {"temperature": 0}}  # fmt: skip
    message = client.messages.create(**args)
    assert [b.type for b in message.content] == ["thinking"] and message.content[0].thinking
    with client.messages.stream(**args) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in message.content]
    # The SDK's loop sends the thinking back in the assistant turn: taken, not shown.
    turn = [*ASK, {"role": "assistant", "content": message.content},
            {"role": "user", "content": "And of Spain?"}]  # fmt: skip
    assert client.messages.create(**{**args, "messages": turn}).content
    redacted = [*turn[:1], {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "Paris."}]},
        turn[2]]  # fmt: skip
    assert client.messages.create(**{**args, "messages": redacted}).content
    for bad in ({"type": "thinking", "thinking": 5}, {"type": "thinking", "signature": []},
                {"type": "redacted_thinking", "data": 5}):  # fmt: skip
        body = {"model": MODEL_NAME, "max_tokens": 8, "messages": [
            *ASK, {"role": "assistant", "content": [bad]}, {"role": "user", "content": "?"}]}  # fmt: skip
        response = server.http().post("/v1/messages", json=body)
        assert response.status_code == 400 and response.json()["type"] == "error", response.text


def test_responses_gives_a_reasoning_item_whole_and_streamed(server):
    client = server.openai()
    args = {"model": MODEL_NAME, "input": ASK[0]["content"], "max_output_tokens": 8,
            "temperature": 0}  # fmt: skip
    r = client.responses.create(**args)
    assert [i.type for i in r.output] == ["reasoning"] and not r.output_text
    text = r.output[0].content[0].text
    events = list(client.responses.create(stream=True, **args))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    [done] = [e.text for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == done == text
    assert [i.content[0].text for i in events[-1].response.output] == [text]
    # An agent sends the reasoning item back with its next input: taken, not shown.
    again = client.responses.create(**{**args, "input": [
        ASK[0], r.output[0].model_dump(exclude_none=True),
        {"role": "user", "content": "And of Spain?"}]})  # fmt: skip
    assert again.status in ("completed", "incomplete")


# ----------------------------------------------------------------------- thinking budgets

FREE = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 16, "temperature": 0}


def test_a_thinking_budget_closes_the_block_and_the_model_answers_whole_and_streamed(server):
    """The random model never leaves the block its prompt opened (all 16 tokens are
    reasoning); with a budget of 4 the engine closes it and the rest is an answer."""
    client = server.openai()
    free = client.chat.completions.create(**FREE).choices[0].message
    assert free.reasoning_content and not free.content
    args = {**FREE, "extra_body": {"thinking_token_budget": 4}}
    capped = client.chat.completions.create(**args)
    message = capped.choices[0].message
    assert free.reasoning_content.startswith(message.reasoning_content)
    assert len(message.reasoning_content) < len(free.reasoning_content) and message.content
    assert capped.usage.completion_tokens == 16
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            reasoning += choice.delta.model_dump().get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)


def test_messages_thinking_budget_tokens_caps_the_thinking_block(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                                 timeout=60)  # fmt: skip
    free = client.messages.create(model=MODEL_NAME, messages=ASK, max_tokens=16,
                                  extra_body={"temperature": 0})  # fmt: skip
    capped = client.messages.create(model=MODEL_NAME, messages=ASK, max_tokens=16,
                                    thinking={"type": "enabled", "budget_tokens": 4},
                                    extra_body={"temperature": 0})  # fmt: skip
    assert [b.type for b in capped.content] == ["thinking", "text"]
    assert free.content[0].thinking.startswith(capped.content[0].thinking)
    assert len(capped.content[0].thinking) < len(free.content[0].thinking)


def test_responses_takes_the_thinking_budget_too(server):
    r = server.openai().responses.create(
        model=MODEL_NAME, input=ASK[0]["content"], max_output_tokens=16, temperature=0,
        extra_body={"thinking_token_budget": 4},
    )  # fmt: skip
    assert [i.type for i in r.output] == ["reasoning", "message"] and r.output_text


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/chat/completions", {"thinking_token_budget": -1}),
        ("/v1/chat/completions", {"thinking_token_budget": "4"}),
        ("/v1/chat/completions", {"thinking_token_budget": 2**40}),
        ("/v1/chat/completions", {"thinking_token_budget": [4]}),
        ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 16}}),
        ("/v1/messages", {"thinking": {"type": "enabled"}}),
        ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 0}}),
        ("/v1/messages", {"thinking": {"type": "sometimes", "budget_tokens": 4}}),
        ("/v1/responses", {"thinking_token_budget": {"n": 4}}),
    ],
)
def test_a_bad_thinking_budget_is_a_400(server, path, extra):
    body = {"model": MODEL_NAME, "max_tokens": 16, **extra}
    if path == "/v1/responses":
        body = {"model": MODEL_NAME, "input": "Hi", **extra}
    else:
        body["messages"] = ASK
    response = server.http().post(path, json=body)
    assert response.status_code == 400, response.text
    assert server.engine.core.kv_cache_manager.num_free_blocks == server.engine.core.num_blocks
