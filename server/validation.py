"""Checks of request values that the request schemas (server/protocol.py) cannot express.

Three kinds, each a 400 in the OpenAI shape naming the field:

* limits only the running model knows: its vocabulary (token ids) and its context length
  (token budgets, prompt plus budget);
* rules between fields that pydantic does not check (`stream_options` needs `stream`,
  `best_of` equals n, a named `tool_choice` names one of `tools`...);
* fields this server knows but cannot honour (protocol.py's `UNSUPPORTED_*`): a request
  that sets one to anything but an empty value is refused, never silently ignored.

The engine (its `_check_prompt`) owns the vocabulary range and context length of
the token prompts it is given. The server checks a prompt against those limits once,
here, only to answer in the OpenAI shape (its message, `param` and `code`) before any of
a request's prompts reaches the engine: `check_token_ids` on a completion's token-id
prompt (server/tokens.py) and `check_context_length` (server/serving.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from engine import fits_context
from server.errors import bad_request
from server.protocol import (
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    UNSUPPORTED_MESSAGE_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIBaseModel,
    SamplingFields,
    TokenizeRequest,
)

# A token id as a JSON object key (logit_bias): plain decimal digits, optionally signed.
TOKEN_ID_KEY = re.compile(r"-?[0-9]+")

# The budget fields a request may carry (chat has both; completions only max_tokens).
_BUDGET_FIELDS = ("max_tokens", "max_completion_tokens")


# ------------------------------------------------------------------ unsupported fields


def is_unset(value: Any) -> bool:
    """Whether an unsupported field's value asks for nothing (null, false, "", [], {})."""
    return value is None or value is False or value == "" or value == [] or value == {}


def reject_unsupported(req: OpenAIBaseModel, names: tuple[str, ...]) -> None:
    """400 for a known-unsupported field set to anything but an empty value."""
    extra = req.model_extra or {}
    for name in names:
        if name in extra and not is_unset(extra[name]):
            raise bad_request(f"`{name}` is not supported by this server.", param=name)


def reject_unsupported_message_fields(message: OpenAIBaseModel, param: str) -> None:
    """400 for a chat message that sets a message field this server cannot honour."""
    extra = message.model_extra or {}
    for key in message.unknown_fields():
        if key in UNSUPPORTED_MESSAGE_FIELDS and not is_unset(extra[key]):
            raise bad_request(f"`{key}` in messages is not supported.", param=f"{param}.{key}")


def check_completion_supported(req: CompletionRequest) -> None:
    reject_unsupported(req, UNSUPPORTED_COMPLETION)
    if req.best_of is not None and req.best_of != req.num_choices:
        raise bad_request(
            f"best_of={req.best_of} is not supported; only best_of == n.", param="best_of"
        )


def check_chat_supported(req: ChatCompletionRequest) -> None:
    reject_unsupported(req, UNSUPPORTED_CHAT)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("`top_logprobs` requires `logprobs: true`.", param="top_logprobs")
    check_tools(req)


def check_tools(req: ChatCompletionRequest) -> None:
    """Function names in `tools` are distinct, and `tool_choice` has something to call."""
    choice, names = req.tool_choice, [t.function.name for t in req.tools or ()]
    if len(set(names)) != len(names):
        raise bad_request("Function names in `tools` must be distinct.", param="tools")
    if choice == "required" and not names:
        raise bad_request('`tool_choice` "required" needs `tools`.', param="tool_choice")
    # The one tool_choice that is not a string names a function.
    if choice is not None and not isinstance(choice, str) and choice.function.name not in names:
        raise bad_request(
            f"`tool_choice` names the function {choice.function.name!r}, which is not in `tools`.",
            param="tool_choice",
        )


def check_tokenize_input(req: TokenizeRequest) -> None:
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("Give exactly one of `prompt` and `messages`.", param="prompt")
    if req.prompt is not None and not is_unset(req.chat_template_kwargs):
        raise bad_request("`chat_template_kwargs` needs `messages` (a prompt is not templated).",
                          param="chat_template_kwargs")  # fmt: skip


# ------------------------------------------------------------------- the model's limits


def check_common(req: SamplingFields, vocab_size: int, max_model_len: int) -> None:
    """Checks SamplingParams.verify does not make: token ids the model can index, and
    token budgets the context can hold next to a prompt of at least one token."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("`stream_options` is only allowed with `stream: true`.",
                          param="stream_options")  # fmt: skip
    check_token_ids(req.stop_token_ids or (), vocab_size, "stop_token_ids")
    parse_logit_bias(req.logit_bias, vocab_size)
    for name in _BUDGET_FIELDS:
        check_budget(name, getattr(req, name, None), max_model_len)


def check_token_ids(
    ids: Iterable[int], vocab_size: int, param: str, what: str = "token id"
) -> None:
    """400 naming the first id outside the vocabulary [0, vocab_size); `what` names the
    kind of id in the message ("prompt token id" for a prompt)."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"{what} {bad} is outside the vocabulary [0, {vocab_size}).", param=param)


def parse_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """logit_bias keyed by token id; 400 for a key that is not an id in the vocabulary."""
    parsed: dict[int, float] = {}
    for key, value in (bias or {}).items():
        # Not int(key): it also reads "1_0" as 10, " 7 " as 7 and Arabic-Indic digits.
        if not TOKEN_ID_KEY.fullmatch(key):
            raise bad_request(f"logit_bias key {key!r} is not a token id.", "logit_bias")
        token = int(key)
        check_token_ids((token,), vocab_size, "logit_bias")
        parsed[token] = value
    return parsed


def check_budget(name: str, value: int | None, max_model_len: int) -> None:
    """400 for a token budget the context cannot hold even beside a one-token prompt.

    `check_context_length` would refuse it too, but only once the prompt is rendered and
    encoded, and naming the prompt; this answers first and names the budget's field."""
    if value is not None and not fits_context(1, value, max_model_len):
        raise bad_request(
            f"`{name}` is {value}, but this model's context of {max_model_len} tokens "
            f"leaves at most {max_model_len - 1} beside the prompt.",
            param=name,
            code="context_length_exceeded",
        )


def check_context_length(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int, prompt_param: str
) -> None:
    """400 (`context_length_exceeded`) when a prompt plus its budget overflow the context.

    The engine refuses such a prompt too (it owns the limit); this, the server's one check
    of it, runs before any of a request's prompts is submitted and answers in OpenAI's
    words, naming both numbers and the field that holds the prompt."""
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
