"""vLLM's `chat_template_kwargs` (issue 62): the request's extra variables reach the chat
template on chat, Responses and /tokenize; Messages' `thinking` is the template's
`enable_thinking`; the reasoning parser reads the think block the template did (or did
not) open; a key that is the renderer's own, and a value that is not a JSON object, is a
400 in the OpenAI shape. A real server on a tiny random model whose template reads
`enable_thinking` as Qwen3's does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest

from tests.engine.tiny_models import make_tiny_model_dir
from tests.server.conftest import (
    MODEL_NAME,
    RunningServer,
    assert_openai_error,
    make_engine,
    running_server,
    wait_until,
)

# `enable_thinking` false renders Qwen3's empty think block, so the model answers at once;
# otherwise the generation prompt opens the block (as Qwen3's thinking-only templates and
# QwQ's do), so the random model's whole output is reasoning. `note` shows that any JSON
# value (here an object) reaches the template as it was sent.
TEMPLATE = """{%- if note is defined %}<|im_start|>system
{{ note.text }}<|im_end|>
{% endif %}{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""
ASK = [{"role": "user", "content": "Capital of France?"}]
TURN = "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n"
THINKING, NOT_THINKING = TURN + "<think>\n", TURN + "<think>\n\n</think>\n\n"
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[RunningServer]:
    path = make_tiny_model_dir(tmp_path_factory.mktemp("qwen3-style-template"))
    Path(path, "chat_template.jinja").write_text(TEMPLATE)
    with running_server(make_engine(path)) as s:  # --reasoning-parser auto: "think"
        yield s


@pytest.fixture(autouse=True)
def _idle_afterwards(server) -> Iterator[None]:
    """Every request, served or refused, leaves the server idle with no KV block held."""
    yield
    wait_until(server.all_blocks_free, 30, "a request kept its KV blocks")


def _ids(server: RunningServer, text: str) -> list[int]:
    return list(server.engine.core.tokenizer.encode(text, add_special_tokens=False))


def _tokenize(server: RunningServer, **extra) -> list[int]:
    body = {"model": MODEL_NAME, "messages": ASK, **extra}
    response = server.http().post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_enable_thinking_renders_the_prompt_the_template_says(server):
    thinking, not_thinking = _ids(server, THINKING), _ids(server, NOT_THINKING)
    assert thinking != not_thinking
    assert _tokenize(server) == thinking  # undefined: the template's default
    assert _tokenize(server, chat_template_kwargs={"enable_thinking": True}) == thinking
    assert _tokenize(server, **OFF) == not_thinking
    note = {"note": {"text": "Be brief."}, "unread": [1, {"x": None}]}
    expected = _ids(server, "<|im_start|>system\nBe brief.<|im_end|>\n" + THINKING)
    assert _tokenize(server, chat_template_kwargs=note) == expected
    # The chat route renders the same prompt the engine is given.
    client = server.openai()
    for extra, ids in (({}, thinking), (OFF, not_thinking), ({"chat_template_kwargs": note},
                                                             expected)):  # fmt: skip
        r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=1,
                                           extra_body=extra)  # fmt: skip
        assert r.usage.prompt_tokens == len(ids), extra


def test_thinking_off_gives_the_whole_output_as_content_whole_and_streamed(server):
    """The greedy output after Qwen3's empty block is all content, no reasoning field; the
    same text /v1/completions gives for the same prompt ids. With thinking on, the random
    model never closes the block the prompt opened: all of it is reasoning."""
    client = server.openai()
    args = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 8, "temperature": 0}
    on = client.chat.completions.create(**args).choices[0].message
    assert on.reasoning_content and not on.content
    body = {**args, **OFF}
    message = server.http().post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"]
    raw = client.completions.create(model=MODEL_NAME, prompt=_tokenize(server, **OFF),
                                    max_tokens=8, temperature=0)  # fmt: skip
    assert message["content"] == raw.choices[0].text
    content = ""
    for chunk in client.chat.completions.create(stream=True, extra_body=OFF, **args):
        for choice in chunk.choices:
            assert not choice.delta.model_dump().get("reasoning_content")
            content += choice.delta.content or ""
    assert content == message["content"]


def test_responses_takes_chat_template_kwargs(server):
    client = server.openai()
    args = {"model": MODEL_NAME, "input": ASK[0]["content"], "max_output_tokens": 8,
            "temperature": 0}  # fmt: skip
    assert [i.type for i in client.responses.create(**args).output] == ["reasoning"]
    off = client.responses.create(extra_body=OFF, **args)
    assert [i.type for i in off.output] == ["message"] and off.output_text
    assert off.usage.input_tokens == len(_ids(server, NOT_THINKING))
    events = list(client.responses.create(stream=True, extra_body=OFF, **args))
    assert not [e for e in events if e.type.startswith("response.reasoning")]
    assert events[-1].response.output[0].content[0].text == off.output_text


def test_messages_thinking_is_the_templates_enable_thinking(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                                 timeout=60)  # fmt: skip
    args = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 8,
            "extra_body": {"temperature": 0}}  # fmt: skip
    disabled = client.messages.create(thinking={"type": "disabled"}, **args)
    assert [b.type for b in disabled.content] == ["text"] and disabled.content[0].text
    prompt = disabled.usage.input_tokens + disabled.usage.cache_read_input_tokens
    assert prompt == len(_ids(server, NOT_THINKING))  # Anthropic counts cache reads apart
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=ASK,
                                           thinking={"type": "disabled"})  # fmt: skip
    assert counted.input_tokens == len(_ids(server, NOT_THINKING))
    enabled = client.messages.create(thinking={"type": "enabled", "budget_tokens": 4}, **args)
    assert enabled.content[0].type == "thinking"
    prompt = enabled.usage.input_tokens + enabled.usage.cache_read_input_tokens
    assert prompt == len(_ids(server, THINKING))


@pytest.mark.parametrize(
    "key",
    ["messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize",
     "chat_template", "bos_token", "eos_token", "raise_exception", "namespace",
     "return_assistant_tokens_mask"],
)  # fmt: skip
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/tokenize"])
def test_a_key_that_is_the_renderers_own_is_a_400_naming_it(server, path, key):
    kwargs = {"enable_thinking": False, key: "x"}
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 4, "chat_template_kwargs": kwargs}
    if path == "/v1/responses":
        body = {"model": MODEL_NAME, "input": "Hi", "chat_template_kwargs": kwargs}
    error = assert_openai_error(server.http().post(path, json=body), 400,
                                f"chat_template_kwargs.{key}")  # fmt: skip
    assert repr(key) in error["message"]


def _deep(levels: int) -> str:
    return '{"a": ' * levels + "1" + "}" * levels


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("/v1/chat/completions", '[{"enable_thinking": false}]'),
        ("/v1/chat/completions", '"enable_thinking=false"'),
        ("/v1/chat/completions", "false"),
        ("/v1/chat/completions", _deep(1000)),
        ("/v1/responses", '[["enable_thinking", false]]'),
        ("/v1/responses", _deep(1000)),
        ("/tokenize", '["enable_thinking"]'),
    ],
)
def test_a_value_that_is_not_a_bounded_json_object_is_a_400(server, path, value):
    head = '"input": "Hi"' if path == "/v1/responses" else f'"messages": {ASK}'.replace("'", '"')
    text = f'{{"model": "{MODEL_NAME}", {head}, "chat_template_kwargs": {value}}}'
    response = server.http().post(path, content=text,
                                  headers={"Content-Type": "application/json"})  # fmt: skip
    error = assert_openai_error(response, 400)
    assert (error["param"] or "").startswith("chat_template_kwargs"), error


def test_tokenize_refuses_template_variables_for_a_plain_prompt(server):
    body = {"model": MODEL_NAME, "prompt": "Hi", **OFF}
    assert_openai_error(server.http().post("/tokenize", json=body), 400, "chat_template_kwargs")
    body["chat_template_kwargs"] = {}  # an empty value asks for nothing
    assert server.http().post("/tokenize", json=body).status_code == 200
