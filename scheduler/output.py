"""What one `Scheduler.schedule()` call asks the model runner to compute."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_cache.state_group import StateStep
from scheduler.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request | None  # None on tensor-parallel ranks 1..N-1, which never sample
    request_id: str
    token_ids: list[int]  # the tokens to compute this step (a fresh list)
    num_computed_tokens: int  # tokens already in the KV cache = position of token_ids[0]
    # The request's whole block table, as the KV cache manager owns it: a tuple it
    # replaces (never mutates) when blocks are added, so it stays valid however long a
    # reader keeps it.
    block_ids: tuple[int, ...]
    # True when the next token after the last position is wanted this step: a decode,
    # or the chunk that completes the prompt (or a preempted request's recomputation).
    sample: bool
    # How many of block_ids (the last ones) this step added: the whole table when the
    # request was admitted this step. Tensor parallelism sends the other ranks only these.
    num_new_blocks: int = 0
    # Speculative decoding: the last this many of token_ids are draft tokens (past the
    # end of all_token_ids). The runner samples each of the 1 + k positions and keeps
    # the drafts its samples agree with (plus one token of its own).
    num_draft_tokens: int = 0
    # A hybrid model's other KV cache groups' tables (kv_cache/hybrid.py), in group order;
    # () for a model of one group.
    group_block_ids: tuple[tuple[int, ...], ...] = ()
    # A model with recurrent layers: what this step does with the request's state slot.
    state: StateStep | None = None


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    # Requests finished or aborted since the previous schedule(): the model runner
    # drops whatever state it keeps for them.
    finished_ids: set[str] = field(default_factory=set)
    num_batched_tokens: int = 0
    # Requests preempted by this step: their blocks are freed; they will be
    # recomputed from the start (mostly from cached blocks) when readmitted.
    preempted_ids: set[str] = field(default_factory=set)
    # Requests whose queue deadline passed while they waited, never scheduled: finished
    # (FINISHED_QUEUE_TIMEOUT) by this schedule(); the caller tells their clients.
    timed_out: list[Request] = field(default_factory=list)

    @property
    def num_sampled(self) -> int:
        return sum(1 for s in self.scheduled if s.sample)
