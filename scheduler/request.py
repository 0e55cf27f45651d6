"""One generation request as the scheduler tracks it: its tokens, progress and status."""

from __future__ import annotations

import enum
import time
from collections.abc import Collection, Sequence
from typing import Any, Protocol

from scheduler.sampling_params import SamplingParams


class Grammar(Protocol):
    """Where a constrained request's output stands in its grammar (the engine's matcher,
    e.g. xgrammar's GrammarMatcher, or a thinking budget's): the scheduler advances it with
    each sampled token."""

    def accept_token(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in `waiting`, blocks freed, to be recomputed
    FINISHED_STOPPED = "finished_stopped"  # eos, a stop token id or (engine) a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "finished_aborted"
    # Still waiting, never scheduled, when its queue deadline passed.
    FINISHED_QUEUE_TIMEOUT = "finished_queue_timeout"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_QUEUE_TIMEOUT: "queue_timeout",
}


class Request:
    """A prompt plus the tokens generated so far.

    `all_token_ids` is one list kept in sync with `output_token_ids` (both are
    appended to) because the KV cache manager reads it every step; rebuilding
    it on access would cost O(length) per request per step.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_ids",
        "stop_screen",
        "cache_salt",
        "arrival_time",
        "priority",
        "queue_deadline",
        "output_token_ids",
        "all_token_ids",
        "num_computed_tokens",
        "status",
        "extra_keys",
        "num_cached_tokens",
        "num_preemptions",
        "stop_reason",
        "generator",
        "grammar",
        "spec_token_ids",
        "spec",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        eos_token_ids: Collection[int] = frozenset(),
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        queue_timeout: float | None = None,
    ) -> None:
        if len(prompt_token_ids) == 0:  # len, not truthiness: arrays are accepted too
            raise ValueError("prompt_token_ids must not be empty")
        if cache_salt is not None and not cache_salt:
            raise ValueError("cache_salt must be non-empty when given")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        # Any number of ids (models with an end-of-text and an end-of-turn token); one
        # frozenset is the only form, so every consumer hashes and tests it alike.
        self.eos_token_ids = frozenset(eos_token_ids)
        # Every token that may stop the request, for a one-lookup screen per step;
        # the exact rules (ignore_eos, min_tokens) run only on a match.
        self.stop_screen = self.eos_token_ids | frozenset(sampling_params.stop_token_ids)
        self.cache_salt = cache_salt
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Lower goes first (vLLM's convention); requests of one priority keep the policy's order.
        self.priority = priority
        # Past this time (the scheduler's clock) a request never scheduled is finished with
        # FINISHED_QUEUE_TIMEOUT instead of waiting on.
        if queue_timeout is not None and not queue_timeout > 0:
            raise ValueError(f"queue_timeout must be > 0 seconds, got {queue_timeout!r}")
        self.queue_deadline = None if queue_timeout is None else self.arrival_time + queue_timeout
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        # Tokens whose KV is in the cache (or is being written by the step just scheduled).
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        # Anything besides the tokens that makes the KV differ: the salt keeps one
        # tenant's cached blocks invisible to another.
        self.extra_keys: tuple = (cache_salt,) if cache_salt is not None else ()
        # Prompt tokens served from the prefix cache at first admission; -1 until then.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # The stop token id that stopped the request (FINISHED_STOPPED by eos or stop_token_ids).
        self.stop_reason: int | None = None
        # The engine's per-request objects, held here so the request owns all its state and
        # nothing outlives it: the random generator of a seeded request (its tokens do not
        # depend on the batch), and the grammar matcher of a constrained one.
        self.generator: Any = None
        self.grammar: Grammar | None = None
        # Speculative decoding: the draft tokens proposed for the next step (the scheduler
        # schedules them after the last token and clears the list), and the engine's
        # per-request drafting state (its acceptance so far).
        self.spec_token_ids: list[int] = []
        self.spec: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """ "stop" | "length" | "abort" | "queue_timeout", or None while unfinished."""
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
