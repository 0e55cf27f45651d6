"""Tool-call formats other than Hermes' (server/tool_formats.py): Llama 3.x JSON and Mistral
`[TOOL_CALLS]` (v3's array and v11's `name[ARGS]{...}`), whole and streamed at every chunk size, the format chosen by the template,
and a tiny random model behind a Llama-style template through the server (its output forced
to a call by a one-string guided_choice).

The templates here are short stand-ins written for these tests: they carry the markers
each family's real template has (`Environment: ipython` / `<|python_tag|>`, `[TOOL_CALLS]`
/ `[AVAILABLE_TOOLS]`), not the real templates' text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.server_config import ServerConfig
from server.tool_formats import parse_tool_output, resolve_tool_parser, tool_stream
from tests.engine.tiny_models import make_tiny_model_dir
from tests.server.conftest import MODEL_NAME, RunningServer, make_engine, running_server

LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
CASES = [
    # (parser, output, content, [(name, arguments)])
    ("llama3_json", LLAMA_CALL, None, [("get_weather", {"city": "Paris"})]),
    ("llama3_json", "<|python_tag|>" + LLAMA_CALL, None, [("get_weather", {"city": "Paris"})]),
    ("llama3_json", LLAMA_CALL + "; " + '{"name": "now", "parameters": {}}', None,
     [("get_weather", {"city": "Paris"}), ("now", {})]),
    ("llama3_json", "It is sunny.", "It is sunny.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ("llama3_json", '{"name": "f", "parameters": ', '{"name": "f", "parameters":', []),  # cut short
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
     [("get_weather", {"city": "Paris"})]),
    ("mistral", '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]', None,
     [("a", {}), ("b", {"x": 1})]),
    ("mistral", "[1] says so.", "[1] says so.", []),
    ("mistral", "[TOOL_CALLS]nonsense", "[TOOL_CALLS]nonsense", []),
    # v11 (Mistral Small 3.1 on): `[TOOL_CALLS]name[ARGS]{...}` per call, as the template
    # writes them, and as they read once the detokenizer drops the two special tokens.
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None,
     [("get_weather", {"city": "Paris"})]),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": 4}[TOOL_CALLS]now[ARGS]{}', None,
     [("add", {"a": 3.5, "b": 4}), ("now", {})]),
    ("mistral", 'add{"a": 1}multiply{"a": 3, "b": 6}', None,
     [("add", {"a": 1}), ("multiply", {"a": 3, "b": 6})]),
    ("mistral", "Paris", "Paris", []),  # a name held to the end, then content
    ("mistral", "Paris is the capital.", "Paris is the capital.", []),
    ("mistral", 'add{"a": 1} and more', 'add{"a": 1} and more', []),
    ("mistral", "[TOOL_CALLS]add[ARGS][1, 2]", "[TOOL_CALLS]add[ARGS][1, 2]", []),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_and_streamed_in_any_chunks_give_the_same_calls(parser, text, content, calls):
    got_content, got_calls = parse_tool_output(parser, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    for size in range(1, len(text) + 1):
        reader, streamed, streamed_calls = tool_stream(parser), "", []
        for start in range(0, len(text), size):
            piece, more = reader.feed(text[start : start + size])
            streamed, streamed_calls = streamed + piece, streamed_calls + more
        piece, more = reader.finish()
        streamed, streamed_calls = streamed + piece, streamed_calls + more
        assert (streamed.strip() or None) == content, size
        assert [(c.name, json.loads(c.arguments)) for c in streamed_calls] == calls, size


def test_text_that_cannot_be_a_call_streams_at_once():
    reader = tool_stream("llama3_json")
    assert reader.feed("Sun") == ("Sun", [])  # not "{" nor "<|python_tag|>": sent now
    reader = tool_stream("mistral")
    assert reader.feed("[") == ("", [])  # may still be "[{" or "[TOOL_CALLS]": held
    assert reader.feed("1] x") == ("[1] x", [])
    reader = tool_stream("mistral")
    assert reader.feed("Paris") == ("", [])  # may be a v11 call's name: held
    assert reader.feed(" is") == ("Paris is", [])  # a space: not a name, sent now


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("{% if tools %}Environment: ipython{% endif %}", "llama3_json"),
        ("{{ '<|python_tag|>' }}{{ tools }}", "llama3_json"),
        ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]", "mistral"),
        ("{{ '[TOOL_CALLS]' }}{{ tools }}", "mistral"),
        ("<tools>{{ tools }}</tools>", "hermes"),
        (None, "hermes"),
    ],
)
def test_auto_chooses_the_format_the_template_names(template, parser):
    assert resolve_tool_parser("auto", template) == parser
    assert resolve_tool_parser("mistral", template) == "mistral"  # the flag wins


@pytest.mark.parametrize("value", ["bogus", "", 1])
def test_a_bad_tool_call_parser_flag_is_refused_at_start_up(value):
    with pytest.raises(ValueError, match="tool"):
        ServerConfig(tool_call_parser=value)


# ----------------------------------------------------------------------- through the server

LLAMA_TEMPLATE = """{%- if tools %}<|im_start|>system
Environment: ipython
Answer with {"name": function name, "parameters": arguments} to call one of:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% endif %}{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory) -> Iterator[RunningServer]:
    path = make_tiny_model_dir(tmp_path_factory.mktemp("llama-tools-model"))
    Path(path, "chat_template.jinja").write_text(LLAMA_TEMPLATE)
    with running_server(make_engine(path)) as s:  # --tool-call-parser auto
        yield s


def test_a_llama_template_reads_json_calls_whole_and_streamed(llama_server):
    client = llama_server.openai()
    args = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": TOOLS, "max_tokens": 60, "extra_body": {"guided_choice": [LLAMA_CALL]}}  # fmt: skip
    choice = client.chat.completions.create(**args).choices[0]
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris"})  # fmt: skip
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    names, arguments, finish = [], "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            assert not c.delta.content
            for d in c.delta.tool_calls or ():
                names += [d.function.name] if d.function and d.function.name else []
                arguments += (d.function.arguments or "") if d.function else ""
    assert (names, json.loads(arguments), finish) == (
        ["get_weather"], {"city": "Paris"}, "tool_calls")  # fmt: skip
