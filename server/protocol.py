"""The OpenAI wire format as pydantic models, and their conversion to `SamplingParams`.

Requests accept what the OpenAI API and vLLM accept. Fields fall in three groups:

* supported: declared below and honoured;
* known but not supported (`suffix`, `best_of` != n, `functions`, ...):
  listed in `UNSUPPORTED_*`; a request that sets one to a non-empty value is a 400,
  never silently ignored;
* anything else: kept by `extra="allow"`, ignored, and named in a logged warning
  (`unknown_fields()`), as vLLM does, so a newer SDK field does not break clients.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from engine import SamplingParams, StructuredOutputs, fits_context
from server import json_body
from server.errors import bad_request

MAX_N = 128
MAX_LOGPROBS = 20
MAX_TOP_K = 2**31 - 1
# Below this temperature sampling is numerically greedy anyway (vLLM does the same), and
# dividing the logits by it could overflow.
MIN_SAMPLING_TEMPERATURE = SamplingParams.GREEDY_TEMPERATURE
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_QUEUE_TIMEOUT_S = 86_400.0  # a day: past it a deadline is no deadline
LOGIT_BIAS_LIMIT = 100.0

# vLLM-style extras and OpenAI fields this server cannot honour.
_UNSUPPORTED_COMMON = (
    "prompt_logprobs",
    "guided_decoding_backend",  # there is one backend, xgrammar
    "guided_whitespace_pattern",
    "structural_tag",
    "allowed_token_ids",
    "bad_words",
    "use_beam_search",
    "length_penalty",
    "truncate_prompt_tokens",
    "prompt_embeds",
    "return_tokens_as_token_ids",
    "logits_processors",
)
UNSUPPORTED_COMPLETION = ("suffix", *_UNSUPPORTED_COMMON)
UNSUPPORTED_CHAT = (
    "functions",
    "function_call",
    "audio",
    "prediction",
    "web_search_options",
    "reasoning_effort",
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "continue_final_message",
    "echo",
    *_UNSUPPORTED_COMMON,
)


# ------------------------------------------------------------------- request schemas
#
# The request models are the request schemas of /openapi.json, so every rule that can be
# said in JSON Schema is said here: single-field bounds as pydantic constraints, rules
# between fields as `json_schema_extra`. Limits only the running server knows (vocabulary,
# context, served model name) are marked with LIMIT_KEY and filled in by server/openapi.py.

LIMIT_KEY = "x-pagedserve-limit"


def _limit(name: str) -> dict[str, Any]:
    return {LIMIT_KEY: name}


NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, json_schema_extra=_limit("token_id"))]
# A token id as a JSON object key (logit_bias): plain decimal digits, optionally signed.
TOKEN_ID_KEY = re.compile(r"-?[0-9]+")
TokenIdKey = Annotated[str, Field(json_schema_extra=_limit("token_id_key"))]
LogitBias = dict[TokenIdKey, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]]
TokenIds = Annotated[list[TokenId], Field(min_length=1, json_schema_extra=_limit("prompt_tokens"))]

# What `reject_unsupported` lets through: the empty values.
_UNSET_SCHEMA: dict[str, Any] = {
    "description": "Not supported by this server: only an empty value is accepted.",
    "anyOf": [
        {"type": "null"},
        {"const": False},
        {"const": ""},
        {"type": "array", "maxItems": 0},
        {"type": "object", "maxProperties": 0},
    ],
}


def _only_with(field: str, schema: dict[str, Any], needs: str, value: Any) -> dict[str, Any]:
    """JSON Schema for "`field`, when it matches `schema`, needs `needs` == `value`"."""
    return {
        "if": {"required": [field], "properties": {field: schema}},
        "then": {"required": [needs], "properties": {needs: {"const": value}}},
    }


def _request_schema(
    unsupported: tuple[str, ...] = (), rules: tuple[dict[str, Any], ...] = ()
) -> Any:
    """A model's json_schema_extra: its unsupported fields and its rules between fields."""

    def extra(schema: dict[str, Any]) -> None:
        schema.setdefault("properties", {}).update(dict.fromkeys(unsupported, _UNSET_SCHEMA))
        if rules:
            schema["allOf"] = list(rules)

    return extra


class OpenAIBaseModel(BaseModel):
    # Unknown fields are kept (and reported by unknown_fields), not rejected. NaN and
    # infinity (Python's json parses them) are refused: no sampling option means them.
    # Strict: JSON types only, as OpenAI does; "yes" is not true and "5" is not 5.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    @model_validator(mode="before")
    @classmethod
    def _integral_numbers_are_integers(cls, data: Any) -> Any:
        # JSON has one number type, and JSON Schema counts 5.0 as an integer; Python's json
        # reads it as a float, which strict validation would refuse for an integer field.
        return _integral_floats_as_ints(data)


def _integral_floats_as_ints(value: Any) -> Any:
    """A copy of a parsed JSON value with every integral float an int. Iterative: the body
    reader bounds the nesting, but pydantic also validates plain Python values."""
    if not isinstance(value, dict | list):
        return _integral(value)
    root: Any = {} if isinstance(value, dict) else [None] * len(value)
    stack = [(value, root)]
    while stack:
        source, copy = stack.pop()
        for key, item in source.items() if isinstance(source, dict) else enumerate(source):
            if isinstance(item, dict | list):
                copy[key] = {} if isinstance(item, dict) else [None] * len(item)
                stack.append((item, copy[key]))
            else:
                copy[key] = _integral(item)
    return root


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _is_unset(value: Any) -> bool:
    return value is None or value is False or value == "" or value == [] or value == {}


def reject_unsupported(req: OpenAIBaseModel, names: tuple[str, ...]) -> None:
    """400 for a known-unsupported field set to anything but an empty value."""
    extra = req.model_extra or {}
    for name in names:
        if name in extra and not _is_unset(extra[name]):
            raise bad_request(f"`{name}` is not supported by this server.", param=name)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


# ------------------------------------------------------------------- structured outputs

JsonSchemaValue = dict[str, Any] | bool


class JsonSchemaFormat(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: JsonSchemaValue | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParam(OpenAIBaseModel):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: JsonSchemaValue | str | None = Field(default=None, alias="json")
    regex: NonEmptyStr | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: NonEmptyStr | None = None
    json_object: bool | None = None


def _json_schema_value(value: JsonSchemaValue | str, param: str) -> JsonSchemaValue:
    """vLLM accepts a schema as an object or as JSON text."""
    if not isinstance(value, str):
        return value
    parsed = json_body.loads_field(value, param)
    if not isinstance(parsed, dict | bool):
        raise bad_request(f"`{param}` must be a JSON schema object.", param=param)
    return parsed


def _from_structured_outputs(so: StructuredOutputsParam) -> tuple[StructuredOutputs, str]:
    given = [
        (name, value)
        for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                            ("grammar", so.grammar), ("json_object", so.json_object or None))
        if value is not None
    ]  # fmt: skip
    if len(given) != 1:
        raise bad_request(
            "`structured_outputs` takes exactly one of json, regex, choice, grammar and "
            f"json_object; got {len(given)}.",
            param="structured_outputs",
        )
    name, value = given[0]
    param = f"structured_outputs.{name}"
    return _structured(name, value, param), param


def _structured(kind: str, value: Any, param: str, strict: bool = True) -> StructuredOutputs:
    if kind == "json":
        return StructuredOutputs.json_schema(_json_schema_value(value, param), strict)
    if kind == "choice":
        return StructuredOutputs.choices(list(value))
    if kind == "json_object":
        return StructuredOutputs("json_object")
    return StructuredOutputs(kind, value)  # type: ignore[arg-type]


def _from_response_format(rf: ResponseFormat) -> tuple[StructuredOutputs, str] | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputs("json_object"), "response_format"
    param = "response_format.json_schema"
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad_request("`response_format` of type json_schema needs `json_schema.schema`.",
                          param=param)  # fmt: skip
    strict = rf.json_schema.strict is not False
    param = f"{param}.schema"
    return _structured("json", rf.json_schema.schema_, param, strict), param


_MIN_REPETITION_PENALTY, _MAX_REPETITION_PENALTY = SamplingParams.REPETITION_PENALTY_RANGE
_STREAM_OPTIONS_NEED_STREAM = _only_with("stream_options", {"type": "object"}, "stream", True)


class SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(default=None, json_schema_extra=_limit("model"))
    n: int | None = Field(default=1, ge=1, le=MAX_N, json_schema_extra=_limit("n"))
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = None
    logit_bias: LogitBias | None = None
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(
        default=None, ge=_MIN_REPETITION_PENALTY, le=_MAX_REPETITION_PENALTY
    )
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    cache_salt: NonEmptyStr | None = None
    # Scheduling (vLLM's `priority`: lower first); seconds a request may wait before its
    # first step, past which it is answered 503 `queue_timeout` (default: --queue-timeout).
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    queue_timeout: float | None = Field(default=None, gt=0, le=MAX_QUEUE_TIMEOUT_S)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and the older
    # guided_* names (at most one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParam | None = None
    guided_json: JsonSchemaValue | str | None = None
    guided_regex: NonEmptyStr | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: NonEmptyStr | None = None

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def structured_output(self) -> tuple[StructuredOutputs, str] | None:
        """The output constraint and the field it came from; 400 when more than one is set."""
        found = []
        if self.response_format is not None:
            found.append(_from_response_format(self.response_format))
        if self.structured_outputs is not None:
            found.append(_from_structured_outputs(self.structured_outputs))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                found.append((_structured(kind, value, f"guided_{kind}"), f"guided_{kind}"))
        return at_most_one_constraint([f for f in found if f is not None])

    def check_common(self, vocab_size: int, max_model_len: int) -> None:
        """Checks SamplingParams.verify does not make: token ids the model can index, and
        token budgets the context can hold next to a prompt of at least one token."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("`stream_options` is only allowed with `stream: true`.",
                              param="stream_options")  # fmt: skip
        for token in self.stop_token_ids or []:
            _check_token_id(token, vocab_size, "stop_token_ids")
        _parse_logit_bias(self.logit_bias, vocab_size)
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(self, name, None)
            if value is not None and not fits_context(1, value, max_model_len):
                raise bad_request(
                    f"`{name}` is {value}, but this model's context of {max_model_len} tokens "
                    f"leaves at most {max_model_len - 1} beside the prompt.",
                    param=name,
                    code="context_length_exceeded",
                )

    def to_sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        choice: int,
        vocab_size: int,
        structured: StructuredOutputs | None = None,
    ) -> SamplingParams:
        """SamplingParams for choice `choice` of n; ValueError("<field> ...") when invalid."""
        seed = self.seed
        if seed is not None and choice:
            seed += choice  # n > 1 with a seed: distinct but reproducible sequences
        temperature = _default(self.temperature, 1.0)
        if 0.0 < temperature < MIN_SAMPLING_TEMPERATURE:
            temperature = 0.0
        fields: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": _default(self.top_p, 1.0),
            "top_k": self.top_k or 0,
            "min_p": self.min_p or 0.0,
            "seed": seed,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": _default(self.repetition_penalty, 1.0),
            "logit_bias": _parse_logit_bias(self.logit_bias, vocab_size),
            "logprobs": logprobs,
            "min_tokens": self.min_tokens or 0,
            "stop": _stop_list(self.stop),
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": bool(self.ignore_eos),
            "include_stop_str_in_output": bool(self.include_stop_str_in_output),
            "skip_special_tokens": self.skip_special_tokens is not False,
            "structured_outputs": structured,
        }
        return SamplingParams(**fields)


def at_most_one_constraint(
    found: list[tuple[StructuredOutputs, str]],
) -> tuple[StructuredOutputs, str] | None:
    if len(found) > 1:
        names = " and ".join(f"`{param}`" for _, param in found)
        raise bad_request(f"Only one output constraint may be given; got {names}.",
                          param=found[1][1])  # fmt: skip
    return found[0] if found else None


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _check_token_id(token: int, vocab_size: int, param: str) -> None:
    if not 0 <= token < vocab_size:
        raise bad_request(
            f"token id {token} is outside the vocabulary [0, {vocab_size}).", param=param
        )


def _parse_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    parsed: dict[int, float] = {}
    for key, value in (bias or {}).items():
        # Not int(key): it also reads "1_0" as 10, " 7 " as 7 and Arabic-Indic digits.
        if not TOKEN_ID_KEY.fullmatch(key):
            raise bad_request(f"logit_bias key {key!r} is not a token id.", "logit_bias")
        token = int(key)
        _check_token_id(token, vocab_size, "logit_bias")
        parsed[token] = value
    return parsed


def check_context_length(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int, prompt_param: str
) -> None:
    total = num_prompt_tokens + max_tokens
    if not fits_context(num_prompt_tokens, max_tokens, max_model_len):
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {total} tokens ({num_prompt_tokens} in the {prompt_param}, "
            f"{max_tokens} for the completion). Please reduce the length of the "
            f"{prompt_param} or of max_tokens.",
            param=prompt_param,
            code="context_length_exceeded",
        )


# --------------------------------------------------------------------------- completions

# A prompt must give the model at least one token; a prompt list at most one prompt per
# sequence a request may ask for.
PromptInput = (
    NonEmptyStr
    | Annotated[list[NonEmptyStr], Field(min_length=1, json_schema_extra=_limit("prompts"))]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1, json_schema_extra=_limit("prompts"))]
)
MaxTokens = Annotated[int, Field(ge=1, json_schema_extra=_limit("max_tokens"))]


class CompletionRequest(SamplingFields):
    """A completions request. Rules beyond this schema (400 when broken): prompts x n at most
    --max-seqs-per-request; min_tokens <= max_tokens; best_of, when set, equals n; every
    prompt's tokens plus max_tokens fit the model's context (max_model_len); at most one
    output constraint (response_format, structured_outputs, guided_*), which must compile."""

    model_config = ConfigDict(
        json_schema_extra=_request_schema(UNSUPPORTED_COMPLETION, (_STREAM_OPTIONS_NEED_STREAM,))
    )

    prompt: PromptInput
    max_tokens: MaxTokens | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = Field(default=None, ge=1)

    def check_supported(self) -> None:
        reject_unsupported(self, UNSUPPORTED_COMPLETION)
        if self.best_of is not None and self.best_of != self.num_choices:
            raise bad_request(
                f"best_of={self.best_of} is not supported; only best_of == n.", param="best_of"
            )

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts as a list of strings and token-id lists (validation saw to >= 1)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# -------------------------------------------------------------------------------- chat


_UNSUPPORTED_MESSAGE_FIELDS = ("function_call", "audio")
# Parts are checked by `_text_part` (its 400 names the part); the schema says the same.
TextPart = Annotated[
    dict[str, Any],
    WithJsonSchema({
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    }),
]  # fmt: skip
_CONTENT_NULL_ONLY_FOR_ASSISTANT = {
    "anyOf": [
        {"properties": {"role": {"const": "assistant"}}},
        {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}},
    ]
}


class FunctionCallParam(OpenAIBaseModel):
    name: NonEmptyStr
    arguments: str  # JSON text, as the API returned it


class ToolCallParam(OpenAIBaseModel):
    """A tool call of an earlier assistant turn, sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(OpenAIBaseModel):
    model_config = ConfigDict(
        json_schema_extra=_request_schema(
            _UNSUPPORTED_MESSAGE_FIELDS, (_CONTENT_NULL_ONLY_FOR_ASSISTANT,)
        )
    )

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this result answers


# OpenAI's rule for function names.
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]


class FunctionDefinition(OpenAIBaseModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: an empty object
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(OpenAIBaseModel):
    name: FunctionName


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: ToolChoiceFunction


# "required" or a named function: something to call must be given.
_TOOL_CHOICE_NEEDS_TOOLS = {
    "if": {
        "required": ["tool_choice"],
        "properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
    },
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
}


class ChatCompletionRequest(SamplingFields):
    """A chat completions request. Rules beyond this schema (400 when broken): n at most
    --max-seqs-per-request; min_tokens <= max_completion_tokens (else max_tokens); the
    rendered messages' tokens plus that budget fit the model's context (max_model_len);
    at most one output constraint (response_format, structured_outputs, guided_*, tools
    with tool_choice "required" or named), which must compile; a named tool_choice names
    a function in `tools`, whose names are distinct; tool_choice "auto" (the default with
    tools) needs a chat template that declares tool support."""

    model_config = ConfigDict(
        json_schema_extra=_request_schema(
            UNSUPPORTED_CHAT,
            (
                _STREAM_OPTIONS_NEED_STREAM,
                _only_with("top_logprobs", {"type": "integer"}, "logprobs", True),
                _TOOL_CHOICE_NEEDS_TOOLS,
            ),
        )
    )

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[Literal["text"]] | None = None
    add_generation_prompt: bool | None = True

    def check_supported(self) -> None:
        reject_unsupported(self, UNSUPPORTED_CHAT)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("`top_logprobs` requires `logprobs: true`.", param="top_logprobs")
        self.check_tools()

    def check_tools(self) -> None:
        choice, names = self.tool_choice, [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise bad_request("Function names in `tools` must be distinct.", param="tools")
        if choice == "required" and not names:
            raise bad_request('`tool_choice` "required" needs `tools`.', param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise bad_request(
                f"`tool_choice` names the function {choice.function.name!r}, which is not in "
                "`tools`.",
                param="tool_choice",
            )

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """How tools are used: "none" (ignored, also when there are none), "auto" (the model
        decides; parsed from its text), "required" (one or more calls) or "named"."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def requested_max_tokens(self) -> int | None:
        return _default(self.max_completion_tokens, self.max_tokens)

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as plain {role, content} dicts for the chat template."""
        return [plain_message(i, m) for i, m in enumerate(self.messages)]


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}  # fmt: skip


def plain_message(i: int, m: ChatMessageParam) -> dict[str, Any]:
    param = f"messages.{i}"
    role = _ROLES[m.role]
    for key in m.unknown_fields():
        if key in _UNSUPPORTED_MESSAGE_FIELDS and not _is_unset(m.model_extra[key]):
            raise bad_request(f"`{key}` in messages is not supported.", param=f"{param}.{key}")
    if m.content is None:
        if role != "assistant":
            raise bad_request("content must not be null.", param=f"{param}.content")
        text = ""
    elif isinstance(m.content, str):
        text = m.content
    else:
        text = "".join(_text_part(part, f"{param}.content.{j}") for j, part in enumerate(m.content))
    message: dict[str, Any] = {"role": role, "content": text}
    if m.name:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [_template_tool_call(c) for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def _template_tool_call(call: ToolCallParam) -> dict[str, Any]:
    """A call as chat templates expect it: arguments as an object (Qwen's template writes
    them with `tojson`, which would quote a JSON string a second time). Arguments that are
    not a JSON object (a call the model cut short) stay the text they were."""
    arguments: Any = call.function.arguments
    try:
        parsed = json_body.loads(arguments)
    except ValueError:  # not JSON, or nested past the limit: kept as the text it was
        parsed = None
    if isinstance(parsed, dict):
        arguments = parsed
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": arguments}}  # fmt: skip


def _text_part(part: dict[str, Any], param: str) -> str:
    if part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise bad_request(
            f"content part type {part.get('type')!r} is not supported; only text parts.",
            param=param,
        )
    return part["text"]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ChatChunkChoice(BaseModel):
    index: int
    # {"role": "assistant", "content": ""} first, then {"content": ...} or {"tool_calls": [...]}
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


# ------------------------------------------------------------------------ models, tokens


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's /tokenize: either `prompt` (completions) or `messages` (chat)."""

    model_config = ConfigDict(
        json_schema_extra=_request_schema(rules=({
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        },))
    )  # fmt: skip

    model: str | None = Field(default=None, json_schema_extra=_limit("model"))
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    return_token_strs: bool | None = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("Give exactly one of `prompt` and `messages`.", param="prompt")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = Field(default=None, json_schema_extra=_limit("model"))
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class ResetPrefixCacheResponse(BaseModel):
    success: bool
