"""The generic tool format: tools on a model whose chat template has no place for them.

A template that names `tools` renders them (and earlier calls and their results) itself,
in the format its model was trained on. Any other template gets this format, so that
tool_choice "auto" and tool loops work on every model:

* The tools are described in the system turn (appended to the conversation's own system
  message, or one of their own), with the answer's format: Hermes' `<tool_call>` blocks,
  which many models have seen in training and the server already parses
  (server/tool_parsers.py).
* An assistant turn's earlier calls are written back into its text as those blocks, and
  tool results become a user turn of `<tool_response>` blocks (consecutive results in one
  turn), so every template, even one that knows only user and assistant turns, takes them.
* For tool_choice "auto" the output is constrained by a structural tag (xgrammar): free
  text, but once the model writes `<tool_call>` the block must be a well-formed call of
  one of the tools, its arguments valid for that tool's schema. The model decides between
  a call and a reply; the grammar only keeps a call well-formed. With a structured-output
  field as well (response_format, Responses' text.format, Messages' output_config), the
  output is either calls or an answer in that format.
"""

from __future__ import annotations

import json
from typing import Any

from engine import StructuredOutputs
from server.tool_parsers import CLOSE_TAG, OPEN_TAG

# Whitespace the grammar allows in a row inside a call's arguments: enough for the usual
# `{"a": 1, "b": 2}`, too little for a small model to pad its way to max_tokens.
MAX_WHITESPACE = 1
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"

_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more of the functions below to help answer the user. "
    "Their signatures:\n<tools>\n{tools}\n</tools>\n\nTo call a function, write for each "
    f'call:\n{OPEN_TAG}\n{{"name": <function name>, "arguments": <arguments as a JSON '
    f"object>}}\n{CLOSE_TAG}\nEach result comes back in a {RESULT_OPEN} block. If no "
    "function is needed, answer the user directly in plain text."
)


def declares_tools(chat_template: Any) -> bool:
    """Whether the template renders the tools it is given (it names them at all)."""
    return "tools" in str(chat_template or "")


def tools_text(tools: list[dict[str, Any]]) -> str:
    """The system turn's description of the tools and of the call format."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return _INSTRUCTIONS.replace("{tools}", lines)


def call_block(name: str, arguments: Any) -> str:
    """One call as the model writes it (and as the grammar's tag begins and ends)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN_TAG}\n{body}\n{CLOSE_TAG}"


def generic_conversation(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The template's messages with tools, calls and results written in as text."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = message["role"]
        # What follows a tool result (more results, the user's next words) shares its user
        # turn: templates that insist on alternating roles refuse two user turns in a row.
        after_result = i > 0 and messages[i - 1]["role"] == "tool"
        if role == "tool":
            _add_user_text(out, _result_block(message.get("content") or ""), after_result)
        elif role == "user" and after_result:
            _add_user_text(out, message["content"], joined=True)
        elif role == "assistant" and message.get("tool_calls"):
            out.append(_assistant_with_calls(message))
        else:
            out.append(message)
    if tools:
        _add_system_text(out, tools_text(tools))
    return out


def _assistant_with_calls(message: dict[str, Any]) -> dict[str, Any]:
    blocks = [call_block(c["function"]["name"], c["function"]["arguments"])
              for c in message["tool_calls"]]  # fmt: skip
    text = "\n".join([message["content"], *blocks] if message.get("content") else blocks)
    plain = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**plain, "content": text}


def _result_block(content: str) -> str:
    return f"{RESULT_OPEN}\n{content}\n{RESULT_CLOSE}"


def _add_user_text(out: list[dict[str, Any]], text: str, joined: bool) -> None:
    """`text` as a user turn of its own, or added to the previous turn."""
    if joined:
        out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
    else:
        out.append({"role": "user", "content": text})


def _add_system_text(out: list[dict[str, Any]], text: str) -> None:
    if out and out[0]["role"] == "system":
        first = out[0]["content"]
        out[0] = {**out[0], "content": f"{first}\n\n{text}" if first else text}
    else:
        out.insert(0, {"role": "system", "content": text})


def auto_constraint(
    tools: list[dict[str, Any]], single: bool, answer: StructuredOutputs | None = None
) -> StructuredOutputs:
    """Free text in which every `<tool_call>` block is a valid call of one of `tools`;
    with `single` (parallel_tool_calls false) the output ends after the first call. With
    an `answer` format (the request's response_format...), the output is one or more calls
    or an answer of that format: an agent's structured final answer after its calls."""
    tags = [_call_tag(t) for t in tools]
    if answer is None:
        # A reply may not write a tool result itself: small models, shown results in
        # <tool_response> blocks, go on to invent the next one.
        form: dict[str, Any] = {"type": "triggered_tags", "triggers": [OPEN_TAG], "tags": tags,
                                "stop_after_first": single, "excludes": [RESULT_OPEN]}  # fmt: skip
    else:
        calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                 "at_least_one": True, "stop_after_first": single}  # fmt: skip
        form = {"type": "or", "elements": [calls, answer_format(answer)]}
    tag = {"type": "structural_tag", "format": form}
    return StructuredOutputs("structural_tag", json.dumps(tag, ensure_ascii=False))


def _call_tag(tool: dict[str, Any]) -> dict[str, Any]:
    """One tool's call block: the wrapper and name fixed, the arguments its schema's."""
    name = json.dumps(tool["function"]["name"], ensure_ascii=False)
    schema = tool["function"].get("parameters") or _NO_PARAMETERS
    return {"type": "tag", "begin": f'{OPEN_TAG}\n{{"name": {name}, "arguments": ',
            "content": json_format(schema), "end": f"}}\n{CLOSE_TAG}"}  # fmt: skip


def answer_format(spec: StructuredOutputs) -> dict[str, Any]:
    """A structured-output constraint as a structural tag's format."""
    if spec.kind == "json":
        return json_format(json.loads(spec.spec))
    if spec.kind == "json_object":
        return json_format({"type": "object"})
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.spec}
    if spec.kind == "choice":
        choices = json.loads(spec.spec)
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in choices]}
    if spec.kind == "grammar":
        return {"type": "grammar", "grammar": spec.spec}
    raise ValueError(f"a {spec.kind} constraint cannot be a tool loop's answer")


def json_format(schema: Any) -> dict[str, Any]:
    """A JSON schema as a structural tag's format, its whitespace runs bounded."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}


_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
