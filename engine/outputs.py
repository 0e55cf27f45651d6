"""What the engine hands back for a request after a step: the core's token ids, then the
output processor's text."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """The sampled token's log-probability and the top alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far (stop string removed unless asked to keep it)
    new_token_ids: list[int]  # tokens added by this step
    new_text: str  # text added by this step (held back while it may start a stop string)
    finished: bool
    # "stop" | "length" | "abort" | "queue_timeout" (never ran) | None while running
    finish_reason: str | None
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprob] | None = None  # one per output token, when asked
    new_logprobs: list[TokenLogprob] | None = None  # the ones this step added
    stop_string: str | None = None  # the stop string that ended it (finish_reason "stop")


@dataclass(slots=True)
class EngineCoreOutput:
    """What the engine core reports for a request after a step: token ids, no text (the
    output processor detokenizes, applies stop strings and accumulates logprobs)."""

    request_id: str
    # The tokens this step added: one, or with speculative decoding the drafts kept and
    # one more ([] for a queue timeout).
    new_token_ids: list[int]
    # "stop" | "length" | "abort" | "queue_timeout" once the core finished it, else None
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop token id that ended it (its text is left out)
    new_logprobs: list[TokenLogprob] | None = None  # when the request asked for logprobs
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
