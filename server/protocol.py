"""The OpenAI wire format: request and response schemas as pydantic models.

Requests accept what the OpenAI API and vLLM accept. Fields fall in three groups:

* supported: declared below and honoured;
* known but not supported (`suffix`, `best_of` != n, `functions`, ...):
  listed in `UNSUPPORTED_*` below (the schema marks them; server/validation.py refuses
  them): a request that sets one to a non-empty value is a 400, never silently ignored;
* anything else: kept by `extra="allow"`, ignored, and named in a logged warning
  (`unknown_fields()`), as vLLM does, so a newer SDK field does not break clients.

This module holds the schemas only, and imports none of the modules that work out what a
request means, which take its models as they are: server/validation.py (checks the
schemas cannot express: the model's vocabulary and context, rules between fields),
server/structured_outputs.py (response_format, structured_outputs, guided_* to the
engine's `StructuredOutputs`), server/chat_rendering.py (messages as the chat template's
input) and server/sampling_params.py (the sampling fields as `SamplingParams`).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from engine import SamplingParams

MAX_N = 128
MAX_LOGPROBS = 20
MAX_TOP_K = 2**31 - 1
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
UNSUPPORTED_MESSAGE_FIELDS = ("function_call", "audio")


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
# A token id as a JSON object key (logit_bias): validation.TOKEN_ID_KEY says which keys.
TokenIdKey = Annotated[str, Field(json_schema_extra=_limit("token_id_key"))]
LogitBias = dict[TokenIdKey, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]]
TokenIds = Annotated[list[TokenId], Field(min_length=1, json_schema_extra=_limit("prompt_tokens"))]

# What `validation.reject_unsupported` lets through: the empty values.
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


# Parts are checked by chat_rendering (its 400 names the part); the schema says the same.
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
            UNSUPPORTED_MESSAGE_FIELDS, (_CONTENT_NULL_ONLY_FOR_ASSISTANT,)
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
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins
            return self.max_completion_tokens
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


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
