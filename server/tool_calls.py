"""Tool calls: the output constraint a chat request's tools impose, and the calls read back.

`ChatCompletionRequest.tool_mode` picks one of:

* "named" (`tool_choice: {"type": "function", ...}`): the output is constrained to that
  function's arguments (its `parameters` schema) and is the call's `arguments` as written.
* "required": the output is constrained to a JSON array of `{"name", "parameters"}`
  objects, one per call (vLLM's form), at least one; one at most with
  `parallel_tool_calls: false`.
  Where the output is gpt-oss' harmony (server/harmony.py), both are one harmony call
  message instead, to that function or to one of the tools: the model's own format.
* "auto": the model answers in text or with calls, parsed out of that text. A chat
  template that declares tool support shows the model its tools, nothing is constrained,
  and the calls are read in the template's format (server/tool_formats.py: Hermes
  `<tool_call>` blocks, Llama 3 JSON or Mistral `[TOOL_CALLS]`); on any other template the
  generic format (server/generic_tools.py) describes them in the system turn, the model
  writes Hermes blocks and a structural tag keeps each call well-formed.
* "none": no calls are read from the output; a template that declares tool support is
  still shown the tools (context for earlier calls), the generic format leaves them out.

Earlier calls and tool results in the conversation render through the template where it
declares tool support, else through the generic format, whatever the mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine import StructuredOutputs
from server.generic_tools import auto_constraint, declares_tools, generic_conversation
from server.harmony import HarmonyStream, call_constraint, parse_harmony
from server.output_schemas import (
    ChatMessage,
    FunctionCall,
    ToolCall,
)
from server.protocol import (
    ChatCompletionRequest,
    ChatTool,
    NamedToolChoice,
)
from server.reasoning import NO_REASONING, ReasoningMode, ReasoningSplitter, split_reasoning
from server.structured_outputs import at_most_one_constraint, request_constraint
from server.tool_formats import parse_tool_output, tool_stream
from server.tool_parsers import CallArrayStream
from server.tool_parsers import ToolCall as ParsedCall
from server.tool_parsers import new_call as new_call_id

# A function declared without parameters takes an empty object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def tool_constraint(
    req: ChatCompletionRequest, generic: bool = False, harmony: bool = False
) -> tuple[StructuredOutputs, str] | None:
    """The grammar a request's tool_choice asks for, and the field it comes from; `generic`:
    the template has no place for tools (the generic format's "auto" is constrained);
    `harmony`: the output is read as harmony."""
    mode = req.tool_mode
    if harmony and mode in ("named", "required"):
        choice = req.tool_choice
        name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        tools = [(t.function.name, _parameters(t)) for t in req.tools or ()
                 if name in (None, t.function.name)]  # fmt: skip
        return call_constraint(tools), "tools"
    if mode == "auto" and generic:
        return auto_constraint(tool_dicts(req), req.parallel_tool_calls is False), "tools"
    if mode == "named":
        assert isinstance(req.tool_choice, NamedToolChoice)
        tool = _tool(req, req.tool_choice.function.name)
        strict = tool.function.strict is not False
        return StructuredOutputs.json_schema(_parameters(tool), strict), "tools"
    if mode == "required":
        single = req.parallel_tool_calls is False
        return StructuredOutputs.json_schema(calls_schema(req.tools or [], single)), "tools"
    return None


def output_constraint(
    req: ChatCompletionRequest, generic: bool = False, harmony: bool = False
) -> tuple[StructuredOutputs, str] | None:
    """The chat request's one output constraint: its structured-output fields' or its
    tools'; 400 when both give one."""
    answer = request_constraint(req)
    if generic and req.tool_mode == "auto" and answer is not None:
        # Calls or the structured answer: one grammar (server/generic_tools.py). A fault in
        # it is reported against the answer's field, the part clients write by hand.
        single = req.parallel_tool_calls is False
        return auto_constraint(tool_dicts(req), single, answer[0]), answer[1]
    found = [c for c in (answer, tool_constraint(req, generic, harmony)) if c is not None]
    return at_most_one_constraint(found)


def calls_schema(tools: list[ChatTool], single: bool = False) -> dict[str, Any]:
    """A JSON array of calls to these tools: each item names one and carries its arguments."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                "parameters": _parameters(tool),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if single:
        schema["maxItems"] = 1
    return schema


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or NO_PARAMETERS


def _tool(req: ChatCompletionRequest, name: str) -> ChatTool:
    return next(t for t in req.tools or () if t.function.name == name)


def template_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools shown to the model (None: none, tool_choice "none" or no tools)."""
    return None if req.tool_mode == "none" else tool_dicts(req)


def tool_dicts(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's tools as plain dicts, as templates and the generic format take them."""
    return [t.model_dump(exclude_none=True) for t in req.tools or ()]


def template_input(
    req: ChatCompletionRequest, messages: list[dict[str, Any]], chat_template: Any
) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """The messages and tools the chat template is given: as they are where the template
    declares tool support, else written in the generic format (tools passed as None).

    A template that declares tool support is shown the tools under tool_choice "none" too,
    as context for the calls earlier in the conversation (the answer is read as text
    only); the generic format leaves them out then, since its description invites calls.
    """
    if declares_tools(chat_template):
        return messages, tool_dicts(req) or None
    return generic_conversation(messages, template_tools(req)), None


def _out(call: ParsedCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _delta(index: int, call: ParsedCall) -> dict[str, Any]:
    return {"index": index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip


class ToolCallReader:
    """One choice's output read as a message: reasoning (with a `reasoning` splitter,
    server/reasoning.py), content and tool calls, whole or streamed."""

    def __init__(
        self,
        req: ChatCompletionRequest,
        reasoning: ReasoningSplitter | None = None,
        tool_parser: str = "hermes",
    ) -> None:
        self._reasoning = reasoning
        self._tool_parser = tool_parser  # "auto"'s format: server/tool_formats.py
        self.mode = req.tool_mode
        choice = req.tool_choice
        self._name = choice.function.name if isinstance(choice, NamedToolChoice) else ""
        self._id = new_call_id()
        self._num_calls = 0
        # gpt-oss' harmony messages carry the reasoning, the answer and the calls at once
        # (under "named" and "required" too: the output is a harmony call, tool_constraint).
        harmony = tool_parser == "harmony"
        self._harmony = HarmonyStream() if harmony else None
        self._hermes = tool_stream(tool_parser) if self.mode == "auto" and not harmony else None
        self._array = CallArrayStream() if self.mode == "required" and not harmony else None

    def message(self, text: str) -> ChatMessage:
        if self._harmony is not None:
            return self._harmony_message(text)
        if self._reasoning is None:
            return self._message(text)
        reasoning, text = split_reasoning(text, self._reasoning)
        message = self._message(text)
        message.reasoning_content = reasoning
        return message

    def feed(self, text: str) -> dict[str, Any]:
        """The delta for newly generated text ({} when nothing can be sent yet)."""
        if self._harmony is not None:
            return self._harmony_delta(*self._harmony.feed(text))
        if self._reasoning is None:
            return self._feed(text)
        reasoning, text = self._reasoning.feed(text)
        return _with_reasoning(reasoning, self._feed(text) if text else {})

    def finish(self) -> dict[str, Any]:
        """The delta for whatever was held back, once the output is complete."""
        if self._harmony is not None:
            return self._harmony_delta(*self._harmony.finish())
        if self._reasoning is None:
            return self._finish()
        reasoning, text = self._reasoning.finish()
        delta = self._feed(text) if text else {}
        return _with_reasoning(reasoning, merge_deltas(delta, self._finish()))

    def _message(self, text: str) -> ChatMessage:
        if self.mode == "none":
            return ChatMessage(content=text)
        if self.mode == "named":
            call = ParsedCall(self._name, text, self._id)
            return ChatMessage(tool_calls=[_out(call)])
        if self.mode == "required":
            # The calls that closed, as the stream delivers them: all of them, or those
            # before max_tokens cut the array (finish_reason "length" says it was cut).
            return ChatMessage(tool_calls=[_out(c) for c in CallArrayStream().feed(text)])
        content, calls = parse_tool_output(self._tool_parser, text)
        return ChatMessage(content=content, tool_calls=[_out(c) for c in calls])

    def _feed(self, text: str) -> dict[str, Any]:
        if self.mode == "none":
            return {"content": text} if text else {}
        if self.mode == "named":
            return self._named_delta(text)
        if self._array is not None:
            return self._calls_delta(self._array.feed(text))
        assert self._hermes is not None
        return self._mixed_delta(*self._hermes.feed(text))

    def _finish(self) -> dict[str, Any]:
        if self._hermes is not None:
            return self._mixed_delta(*self._hermes.finish())
        if self.mode == "named" and not self._num_calls:
            return self._named_delta("")
        return {}

    def _harmony_message(self, text: str) -> ChatMessage:
        reasoning, content, calls = parse_harmony(text)
        calls = self._harmony_calls(calls)
        message = ChatMessage(content=content or (None if calls else ""),
                              tool_calls=[_out(c) for c in calls])  # fmt: skip
        message.reasoning_content = reasoning
        return message

    def _harmony_delta(self, reasoning: str, content: str, calls: list[ParsedCall]) -> dict:
        return _with_reasoning(reasoning, self._mixed_delta(content, self._harmony_calls(calls)))

    def _harmony_calls(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        """The calls read: none under "none" (their messages dropped), else all (under
        "named" and "required" the grammar let only the allowed ones through)."""
        return calls if self.mode != "none" else []

    @property
    def made_calls(self) -> bool:
        return self._num_calls > 0

    def _named_delta(self, text: str) -> dict[str, Any]:
        if self._num_calls:
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        self._num_calls = 1
        return {"tool_calls": [_delta(0, ParsedCall(self._name, text, self._id))]}

    def _calls_delta(self, calls: list[ParsedCall]) -> dict[str, Any]:
        if not calls:
            return {}
        start, self._num_calls = self._num_calls, self._num_calls + len(calls)
        return {"tool_calls": [_delta(start + i, c) for i, c in enumerate(calls)]}

    def _mixed_delta(self, content: str, calls: list[ParsedCall]) -> dict[str, Any]:
        delta = self._calls_delta(calls)
        if content:
            delta["content"] = content
        return delta


@dataclass(frozen=True)
class OutputReading:
    """How one request's output is read: its reasoning (server/reasoning.py) and, under
    tool_choice "auto", the tool-call format (server/tool_formats.py)."""

    reasoning: ReasoningMode = NO_REASONING
    tool_parser: str = "hermes"

    def reader(self, req: ChatCompletionRequest) -> ToolCallReader:
        return ToolCallReader(req, self.reasoning.splitter(), self.tool_parser)


def _with_reasoning(reasoning: str, delta: dict[str, Any]) -> dict[str, Any]:
    return {"reasoning_content": reasoning, **delta} if reasoning else delta


def merge_deltas(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two deltas as one: their reasoning and content joined, their tool calls in order."""
    merged = dict(first)
    for key in ("reasoning_content", "content"):
        if key in then:
            merged[key] = merged.get(key, "") + then[key]
    if "tool_calls" in then:
        merged["tool_calls"] = merged.get("tool_calls", []) + then["tool_calls"]
    return merged


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI reports a turn that ended in tool calls as "tool_calls"."""
    return "tool_calls" if made_calls and reason == "stop" else reason
