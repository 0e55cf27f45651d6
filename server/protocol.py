"""The OpenAI wire format's requests as pydantic models (their answers are in
server/output_schemas.py; what every request schema is built on, in server/request_base.py).

Requests accept what the OpenAI API and vLLM accept. Fields fall in three groups:

* supported: declared below and honoured;
* known but not supported (`suffix`, `best_of` != n, `functions`, ...):
  listed in `UNSUPPORTED_*` below (the schema marks them; server/validation.py refuses
  them): a request that sets one to a non-empty value is a 400, never silently ignored;
* anything else: kept by `extra="allow"`, ignored, and named in a logged warning
  (`unknown_fields()`), as vLLM does, so a newer SDK field does not break clients.

This module holds the request schemas only, and imports none of the modules that work out
what a request means, which take its models as they are: server/validation.py (checks the
schemas cannot express: the model's vocabulary and context, rules between fields),
server/structured_outputs.py (response_format, structured_outputs, guided_* to the
engine's `StructuredOutputs`), server/chat_rendering.py (messages as the chat template's
input) and server/sampling_params.py (the sampling fields as `SamplingParams`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema

from engine import SamplingParams
from server.request_base import (
    FunctionName,
    MaxTokens,
    NonEmptyStr,
    OpenAIBaseModel,
    only_with,
    schema_extra,
    server_limit,
)

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
    "logits_processors",
)
UNSUPPORTED_COMPLETION = ("suffix", *_UNSUPPORTED_COMMON)
UNSUPPORTED_CHAT = (
    "functions",
    "function_call",
    "audio",
    "prediction",
    "web_search_options",
    "chat_template",
    "documents",
    "continue_final_message",
    "echo",
    *_UNSUPPORTED_COMMON,
)
UNSUPPORTED_MESSAGE_FIELDS = ("function_call", "audio")

# vLLM's `chat_template_kwargs`: extra variables for the chat template (Qwen3's
# `enable_thinking`). A key that is one of the renderer's own names, which would replace
# what the server passes or what the template relies on, is a 400 naming it: the
# renderer's arguments and the variables it sets, jinja's and transformers' template
# functions, and the tokenizer's special tokens (server/tokens.py adds any other special
# token or argument the loaded tokenizer has).
RESERVED_TEMPLATE_KWARGS = (
    "messages", "conversation", "conversations", "tools", "documents",
    "add_generation_prompt", "continue_final_message", "chat_template", "tokenize",
    "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "raise_exception", "strftime_now", "range", "dict", "lipsum", "cycler", "joiner",
    "namespace",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
    "mask_token", "additional_special_tokens",
)  # fmt: skip


# ------------------------------------------------------------------- request schemas
# Written as every request schema is (server/request_base.py): a rule JSON Schema can say
# is said in the schema; a limit only the running server knows is marked for /openapi.json.

TokenId = Annotated[int, Field(ge=0, json_schema_extra=server_limit("token_id"))]
# A token id as a JSON object key (logit_bias): validation.TOKEN_ID_KEY says which keys.
TokenIdKey = Annotated[str, Field(json_schema_extra=server_limit("token_id_key"))]
LogitBias = dict[TokenIdKey, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]]
TokenIds = Annotated[
    list[TokenId], Field(min_length=1, json_schema_extra=server_limit("prompt_tokens"))
]


# OpenAI's reasoning efforts (chat's `reasoning_effort`, Responses' `reasoning.effort`).
ReasoningEffort = Literal["minimal", "low", "medium", "high"]
# Any JSON object (its nesting bounded by the body reader, server/json_body.py) whose keys
# are not the renderer's own.
TemplateKwargs = Annotated[
    dict[str, Any],
    Field(json_schema_extra={"propertyNames": {"not": {"enum": list(RESERVED_TEMPLATE_KWARGS)}}}),
]
TOKENS_AS_IDS_NOTE = (
    "vLLM's: with logprobs, every token in them (the chosen one and each top_logprobs "
    'entry) is written as "token_id:<id>" rather than as its text, so the exact tokens '
    "can be compared across requests. Null: the server's --return-tokens-as-token-ids."
)
TEMPLATE_KWARGS_NOTE = (
    'Extra chat template variables (vLLM\'s), e.g. `{"enable_thinking": false}`; a key '
    "that is the renderer's own (messages, tools, add_generation_prompt, the special "
    "tokens...) is a 400 naming it."
)


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
_STREAM_OPTIONS_NEED_STREAM = only_with("stream_options", {"type": "object"}, "stream", True)


class SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(default=None, json_schema_extra=server_limit("model"))
    n: int | None = Field(default=1, ge=1, le=MAX_N, json_schema_extra=server_limit("n"))
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
    # False: this request never verifies draft tokens (where the server runs
    # --speculative); the output is the same, only its speed differs.
    speculative: bool | None = True
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
    # Token ids instead of token texts in the logprobs (server/serving.py's tokens_as_ids).
    return_tokens_as_token_ids: bool | None = Field(default=None, description=TOKENS_AS_IDS_NOTE)

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
    | Annotated[list[NonEmptyStr], Field(min_length=1, json_schema_extra=server_limit("prompts"))]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1, json_schema_extra=server_limit("prompts"))]
)


class CompletionRequest(SamplingFields):
    """A completions request. Rules beyond this schema (400 when broken): prompts x n at most
    --max-seqs-per-request; min_tokens <= max_tokens; best_of, when set, equals n; every
    prompt's tokens plus max_tokens fit the model's context (max_model_len); at most one
    output constraint (response_format, structured_outputs, guided_*), which must compile."""

    model_config = ConfigDict(
        json_schema_extra=schema_extra(UNSUPPORTED_COMPLETION, (_STREAM_OPTIONS_NEED_STREAM,))
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
        json_schema_extra=schema_extra(
            UNSUPPORTED_MESSAGE_FIELDS, (_CONTENT_NULL_ONLY_FOR_ASSISTANT,)
        )
    )

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this result answers


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
    a function in `tools`, whose names are distinct. tool_choice "auto" (the default with
    tools) on a template without tools is served in the generic format: its grammar must
    compile too, and a structured-output field beside it is the answer's format."""

    model_config = ConfigDict(
        json_schema_extra=schema_extra(
            UNSUPPORTED_CHAT,
            (
                _STREAM_OPTIONS_NEED_STREAM,
                only_with("top_logprobs", {"type": "integer"}, "logprobs", True),
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
    # vLLM's cap on a reasoning model's think block (server/reasoning.py): after this many
    # tokens inside it the server closes it and the model answers. 400 where the server
    # reads no think blocks; no effect under an output constraint (no block there).
    thinking_token_budget: int | None = Field(default=None, ge=0, le=2**31 - 1)
    chat_template_kwargs: TemplateKwargs | None = Field(
        default=None, description=TEMPLATE_KWARGS_NOTE
    )
    # The chat template's `reasoning_effort` (gpt-oss' writes it into its system message's
    # "Reasoning:" line); a template that does not read it is unchanged. A
    # chat_template_kwargs entry of that name wins.
    reasoning_effort: ReasoningEffort | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: chat_template_kwargs and reasoning_effort."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

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


# ------------------------------------------------------------------------ models, tokens


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's /tokenize: either `prompt` (completions) or `messages` (chat)."""

    model_config = ConfigDict(
        json_schema_extra=schema_extra(rules=({
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        }, {
            # the template's variables: with messages only
            "if": {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
            "then": {"properties": {"chat_template_kwargs": {
                "anyOf": [{"type": "null"}, {"type": "object", "maxProperties": 0}]}}},
        }))
    )  # fmt: skip

    model: str | None = Field(default=None, json_schema_extra=server_limit("model"))
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    chat_template_kwargs: TemplateKwargs | None = Field(
        default=None, description=TEMPLATE_KWARGS_NOTE
    )
    return_token_strs: bool | None = False


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = Field(default=None, json_schema_extra=server_limit("model"))
    tokens: list[TokenId]
