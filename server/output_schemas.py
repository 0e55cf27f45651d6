"""The OpenAI wire format's answers: the bodies and stream chunks of completions and chat
completions, and of the model list, /tokenize, /detokenize and the cache reset, as pydantic
models (server/protocol.py holds the requests they answer).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

# --------------------------------------------------------------------------- completions


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
    # A reasoning model's think block (server/reasoning.py); left out when there is none,
    # so answers of other models keep OpenAI's exact shape.
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _drop_absent_reasoning(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("reasoning_content") is None:
            data.pop("reasoning_content", None)
        return data


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


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ResetPrefixCacheResponse(BaseModel):
    success: bool
