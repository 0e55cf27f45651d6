"""gpt-oss' harmony format (server/harmony.py): the reader on its own, whole and streamed at
every chunk size; through the server on a tiny gpt-oss whose tokenizer has harmony's
special tokens and whose template writes harmony, its output forced (a one-string
guided_choice) to an analysis message and an answer, or to a call: reasoning, content and
tool calls on chat completions, whole and streamed, and a tool loop through the OpenAI SDK;
the reasoning effort into the template; and the Messages and Responses views
(which take no guided_choice) over the same outputs, whole and streamed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest
from transformers import AutoTokenizer

from engine import RequestOutput
from server import messages, responses
from server.harmony import HarmonyStream, parse_harmony
from server.protocol import ChatCompletionRequest
from server.tool_calls import OutputReading, tool_constraint
from server.tool_formats import resolve_tool_parser
from tests.engine.tiny_models import VOCAB_SIZE, make_tiny_model_dir
from tests.server.conftest import MODEL_NAME, RunningServer, make_engine, running_server

ANALYSIS = "<|channel|>analysis<|message|>The user asks for a capital.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Paris.<|return|>"
CALL = ('<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json'
        '<|message|>{"city": "Paris"}<|call|>')  # fmt: skip
CASES = [
    # (output, reasoning, content, calls as (name, arguments))
    (ANALYSIS + FINAL, "The user asks for a capital.", "Paris.", []),
    ("<|channel|>final<|message|>Hi", None, "Hi", []),
    ("a plain answer", None, "a plain answer", []),
    (ANALYSIS + CALL, "The user asks for a capital.", "", [("get_weather", '{"city": "Paris"}')]),
    # the recipient after the channel, and a call cut short that still parses
    ('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}', None, "",
     [("f", '{"a": 1}')]),
    # a preamble on commentary is content; a body that is not JSON stays visible
    ("<|channel|>commentary<|message|>Checking.<|end|>"
     "<|start|>assistant to=functions.f<|channel|>commentary<|message|>not json<|call|>",
     None, "Checking.not json", []),
    # a built-in tool's message is dropped; an analysis cut short is reasoning
    ("<|channel|>analysis<|message|>look<|end|><|start|>assistant to=browser.search"
     "<|channel|>analysis<|message|>{}<|call|>", "look", "", []),
    ("<|channel|>analysis<|message|>cut sho", "cut sho", "", []),
]  # fmt: skip


def _calls(calls) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_the_reader_gives_the_same_messages_whole_or_in_any_chunks(text, reasoning, content, calls):
    got_reasoning, got_content, got_calls = parse_harmony(text)
    assert (got_reasoning, got_content, _calls(got_calls)) == (reasoning, content, calls)
    for size in range(1, len(text) + 1):
        stream, parts = HarmonyStream(), [[], [], []]
        for start in range(0, len(text), size):
            for part, got in zip(parts, stream.feed(text[start : start + size]), strict=True):
                part.append(got)
        for part, got in zip(parts, stream.finish(), strict=True):
            part.append(got)
        joined = ("".join(parts[0]), "".join(parts[1]).strip(), _calls(sum(parts[2], [])))
        assert joined == (reasoning or "", content, calls), size


def test_auto_picks_harmony_where_the_template_writes_channels():
    assert resolve_tool_parser("auto", TEMPLATE) == "harmony"
    assert resolve_tool_parser("hermes", TEMPLATE) == "hermes"


# ----------------------------------------------------------------------- through the server

SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
            "<|return|>", "<|call|>"]  # fmt: skip
# A short harmony template: the tools as a developer message, each turn a message, the
# generation prompt `<|start|>assistant` (gpt-oss' own also renders earlier calls and
# reasoning; the reader does not depend on it).
TEMPLATE = """<|start|>system<|message|>Reasoning: {{ reasoning_effort | default("as the request leaves it: medium") }}<|end|>
{%- if tools %}<|start|>developer<|message|># Tools
{% for tool in tools %}{{ tool.function.name }}: {{ tool.function.description }}
{% endfor %}<|end|>{% endif -%}
{%- set ns = namespace(called="") %}
{%- for message in messages %}{% if message.role == "assistant" and message.tool_calls -%}
{%- for call in message.tool_calls %}{% set ns.called = call.function.name -%}
<|start|>assistant to=functions.{{ call.function.name }}<|channel|>commentary json<|message|>
{%- if call.function.arguments is mapping %}{{ call.function.arguments | tojson }}
{%- else %}{{ call.function.arguments }}{% endif %}<|call|>{% endfor -%}
{%- elif message.role == "assistant" -%}
<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>
{%- elif message.role == "tool" -%}
<|start|>functions.{{ ns.called }} to=assistant<|channel|>commentary<|message|>{{ message.content }}<|end|>
{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{% endif %}{% endfor -%}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""
ASK = [{"role": "user", "content": "Capital of France?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
REASONING = "The user asks for a capital."


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[RunningServer]:
    path = make_tiny_model_dir(tmp_path_factory.mktemp("harmony"), arch="gpt_oss", seed=4,
                               vocab_size=VOCAB_SIZE + len(SPECIALS))  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.save_pretrained(path)
    Path(path, "chat_template.jinja").write_text(TEMPLATE)
    with running_server(make_engine(path, num_blocks=128)) as s:
        yield s


def _forced(output: str, **extra) -> dict:
    return {"model": MODEL_NAME, "messages": ASK, "max_tokens": 160,
            "extra_body": {"guided_choice": [output]}, **extra}  # fmt: skip


def _streamed_chat(client, args: dict) -> tuple[str, str, list[dict], str]:
    reasoning, content, calls, finish = "", "", [], ""
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            calls += [c["function"] for c in delta.get("tool_calls") or []]
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


def test_chat_reads_reasoning_and_the_answer_whole_and_streamed(server):
    client = server.openai()
    args = _forced(ANALYSIS + FINAL)
    whole = client.chat.completions.create(**args).choices[0]
    assert (whole.message.reasoning_content, whole.message.content) == (REASONING, "Paris.")
    assert not whole.message.tool_calls
    assert _streamed_chat(client, args) == (REASONING, "Paris.", [], "stop")


def test_chat_reads_a_call_whole_and_streamed(server):
    client = server.openai()
    args = _forced(ANALYSIS + CALL, tools=TOOLS)
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.reasoning_content == REASONING
    (call,) = whole.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    reasoning, content, calls, finish = _streamed_chat(client, args)
    assert (reasoning, content, finish) == (REASONING, "", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_an_openai_sdk_tool_loop_goes_through_harmony(server):
    """The call, its result sent back (rendered as harmony's call and tool messages), and
    the answer that uses it (forced)."""
    client = server.openai()
    first = client.chat.completions.create(**_forced(ANALYSIS + CALL, tools=TOOLS)).choices[0]
    (call,) = first.message.tool_calls
    messages = [*ASK, first.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]  # fmt: skip
    prompt = server.http().post("/tokenize", json={"model": MODEL_NAME, "messages": messages,
                                                   "tools": TOOLS}).json()["tokens"]  # fmt: skip
    text = server.http().post("/detokenize", json={"model": MODEL_NAME, "tokens": prompt})
    assert "assistant to=functions.get_weather" in text.json()["prompt"]
    assert "functions.get_weather to=assistant" in text.json()["prompt"]
    answer = "<|channel|>final<|message|>18 C and sunny in Paris."
    second = client.chat.completions.create(**{**_forced(answer, tools=TOOLS),
                                               "messages": messages}).choices[0]  # fmt: skip
    assert second.message.content == "18 C and sunny in Paris." and second.finish_reason == "stop"


def test_tool_choice_none_reads_no_call(server):
    args = _forced(ANALYSIS + CALL, tools=TOOLS, tool_choice="none")
    choice = server.openai().chat.completions.create(**args).choices[0]
    assert not choice.message.tool_calls and choice.finish_reason == "stop"


# One city of two: a random model's arguments under the grammar stay short.
CITY_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time.",
                                      "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_calls_are_harmony_call_messages_whole_and_streamed(server, tool_choice):
    """tool_choice "required" or a named function holds the model to a harmony call message
    (a bare JSON answer, the other templates' form, would read as content here), whole and
    streamed: one call, finish reason tool_calls, no content."""
    client = server.openai()
    args = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 64, "tools": CITY_TOOLS,
            "tool_choice": tool_choice, "temperature": 0.0}  # fmt: skip
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "tool_calls" and not whole.message.content
    (call,) = whole.message.tool_calls
    names = ["get_weather"] if tool_choice == NAMED else ["get_weather", "get_time"]
    assert call.function.name in names
    if call.function.name == "get_weather":
        assert json.loads(call.function.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    reasoning, content, calls, finish = _streamed_chat(client, args)
    assert (reasoning, content, finish) == ("", "", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]


def test_an_anthropic_sdk_tool_loop_goes_through_harmony(server):
    """Messages: a forced tool (tool_choice "tool") is a harmony call read as a tool_use
    block, whole and streamed alike; its tool_result goes back, rendered as harmony's tool
    message, and the next turn (no call allowed) is text."""
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                                 timeout=60)  # fmt: skip
    tool = CITY_TOOLS[0]["function"]
    args = {"model": MODEL_NAME, "max_tokens": 64, "messages": ASK,
            "tools": [{"name": tool["name"], "description": tool["description"],
                       "input_schema": tool["parameters"]}],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "extra_body": {"temperature": 0}}  # fmt: skip
    first = client.messages.create(**args)
    with client.messages.stream(**args) as events:
        streamed = events.get_final_message()
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use.name == "get_weather"
    assert use.input in ({"city": "Paris"}, {"city": "Rome"})
    assert [(b.type, getattr(b, "input", None)) for b in streamed.content] == [
        (b.type, getattr(b, "input", None)) for b in first.content
    ]
    messages = [*ASK, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": "18 C, sunny"}]}]  # fmt: skip
    second = client.messages.create(**{**args, "messages": messages,
                                       "tool_choice": {"type": "none"}})  # fmt: skip
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert not [b for b in second.content if b.type == "tool_use"]
    count = client.messages.count_tokens(model=MODEL_NAME, messages=messages, tools=args["tools"])
    assert count.input_tokens > client.messages.count_tokens(
        model=MODEL_NAME, messages=ASK, tools=args["tools"]).input_tokens  # fmt: skip


def test_the_forced_call_grammar_is_harmonys_header_then_the_arguments():
    req = ChatCompletionRequest(model=MODEL_NAME, messages=ASK, tools=CITY_TOOLS,
                                tool_choice=NAMED)  # fmt: skip
    spec, field = tool_constraint(req, harmony=True)
    tag = json.loads(spec.spec)["format"]
    assert field == "tools" and spec.kind == "structural_tag"
    assert tag["begin"] == ("<|channel|>commentary to=functions.get_weather <|constrain|>json"
                            "<|message|>") and tag["end"] == "<|call|>"  # fmt: skip
    assert tag["content"]["json_schema"] == CITY_TOOLS[0]["function"]["parameters"]
    required = req.model_copy(update={"tool_choice": "required"})
    elements = json.loads(tool_constraint(required, harmony=True)[0].spec)["format"]["elements"]
    assert ["functions.get_weather " in e["begin"] for e in elements] == [True, False]
    assert tool_constraint(required)[0].kind == "json"  # other templates: the JSON array


def test_reasoning_effort_reaches_the_template_on_chat_and_responses(server):
    def tokens(**kwargs) -> int:
        body = {"model": MODEL_NAME, "messages": ASK, **kwargs}
        return server.http().post("/tokenize", json=body).json()["count"]

    high, unstated = tokens(chat_template_kwargs={"reasoning_effort": "high"}), tokens()
    assert high != unstated
    client = server.openai()
    chat = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=1,
                                          reasoning_effort="high")  # fmt: skip
    assert chat.usage.prompt_tokens == high
    answer = client.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=1,
                                     reasoning={"effort": "high"})  # fmt: skip
    assert answer.usage.input_tokens == high
    message = server.http().post("/v1/messages", json={
        "model": MODEL_NAME, "messages": ASK, "max_tokens": 1,
        "output_config": {"effort": "high"}}).json()  # fmt: skip
    assert message["usage"]["input_tokens"] + message["usage"]["cache_read_input_tokens"] == high
    bad = server.http().post("/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": ASK, "reasoning_effort": "extreme"})  # fmt: skip
    assert bad.status_code == 400 and "reasoning_effort" in bad.text


# Messages and Responses take no guided_choice to force the output, so their views (the
# same reader, behind their own shapes) read a harmony output the engine reports.


class _Ctx:
    served_model_name = MODEL_NAME
    responses = None  # (store=False: nothing is stored)


def _outputs(text: str, size: int) -> list[RequestOutput]:
    """The engine's outputs for `text`, `size` characters a step."""
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    return [RequestOutput(request_id="r-0", prompt_token_ids=[1], token_ids=[1] * (i + 1),
                          text="".join(pieces[: i + 1]), new_token_ids=[1], new_text=piece,
                          finished=i == len(pieces) - 1,
                          finish_reason="stop" if i == len(pieces) - 1 else None,
                          num_cached_tokens=0)
            for i, piece in enumerate(pieces)]  # fmt: skip


class _Stream:
    request_ids = ["r-0"]

    def __init__(self, outs: list[RequestOutput]) -> None:
        self._outs = outs

    async def __aiter__(self):
        for out in self._outs:
            yield out


def _events(view, text: str, size: int) -> list[dict]:
    async def collect() -> list[str]:
        return [chunk async for chunk in view.chunks(_Stream(_outputs(text, size)))]

    return [json.loads(line[len("data: ") :]) for chunk in asyncio.run(collect())
            for line in chunk.splitlines() if line.startswith("data: ")]  # fmt: skip


def _chat(tools: bool) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": MODEL_NAME, "messages": ASK, **({"tools": TOOLS} if tools else {})}
    )


HARMONY = OutputReading(tool_parser="harmony")


@pytest.mark.parametrize("size", [1, 7, 1000])
def test_messages_gives_thinking_text_and_tool_use_blocks(size):
    view = messages._MessagesView(_Ctx(), _chat(False), "r", 3, HARMONY)
    answer = view.response({"r-0": _outputs(ANALYSIS + FINAL, 1000)[-1]})
    assert [(b["type"], b.get("thinking") or b.get("text")) for b in answer.content] == [
        ("thinking", REASONING), ("text", "Paris.")]  # fmt: skip
    events = _events(view, ANALYSIS + FINAL, size)
    started = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert started == ["thinking", "text"]
    view = messages._MessagesView(_Ctx(), _chat(True), "r", 3, HARMONY)
    called = view.response({"r-0": _outputs(ANALYSIS + CALL, 1000)[-1]})
    assert called.stop_reason == "tool_use"
    assert [(b["name"], b["input"]) for b in called.content if b["type"] == "tool_use"] == [
        ("get_weather", {"city": "Paris"})]  # fmt: skip
    events = _events(view, ANALYSIS + CALL, size)
    (use,) = [e["content_block"] for e in events if e["type"] == "content_block_start"
              and e["content_block"]["type"] == "tool_use"]  # fmt: skip
    assert use["name"] == "get_weather"


@pytest.mark.parametrize("size", [1, 7, 1000])
def test_responses_gives_a_reasoning_item_and_a_function_call(size):
    req = responses.ResponsesRequest.model_validate({"model": MODEL_NAME, "input": "Hi",
                                                     "store": False})  # fmt: skip
    view = responses._ResponsesView(_Ctx(), req, _chat(False), "r", 3, [], HARMONY)
    answer = view.response({"r-0": _outputs(ANALYSIS + FINAL, 1000)[-1]})
    assert [item["type"] for item in answer.output] == ["reasoning", "message"]
    events = _events(view, ANALYSIS + FINAL, size)
    (done,) = [e["response"] for e in events if e["type"] == "response.completed"]
    assert [item["type"] for item in done["output"]] == ["reasoning", "message"]
    view = responses._ResponsesView(_Ctx(), req, _chat(True), "r", 3, [], HARMONY)
    events = _events(view, ANALYSIS + CALL, size)
    (done,) = [e["response"] for e in events if e["type"] == "response.completed"]
    (call,) = [item for item in done["output"] if item["type"] == "function_call"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
