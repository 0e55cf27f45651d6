"""A fake paged "model" and a step driver that checks the scheduler's invariants every step.

The fake model keeps a token per KV slot, writes each scheduled token into the
slot its block table and position name, and computes the next token from the
sequence it reads back through the block table. So a wrong position, a wrong
block table or a prefix-cache hit with the wrong contents changes the output.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence

from kv_cache.host_tier import HostTier
from scheduler import (
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

VOCAB = 97


def fake_next_token(tokens: Sequence[int]) -> int:
    """A deterministic function of the whole sequence so far."""
    return (sum(tokens[-3:]) * 31 + len(tokens)) % VOCAB


def reference_generate(
    prompt: Sequence[int],
    params: SamplingParams,
    eos_token_ids: Collection[int],
    max_model_len: int,
    next_token: Callable[[Sequence[int]], int] = fake_next_token,
) -> tuple[list[int], str]:
    """The outputs and finish reason of one request run alone, without any scheduler."""
    tokens = list(prompt)
    out: list[int] = []
    while True:
        token = next_token(tokens)
        tokens.append(token)
        out.append(token)
        stop_ok = len(out) >= params.min_tokens
        if stop_ok and (
            (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
        ):
            return out, "stop"
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out, "length"


class FakePagedModel:
    def __init__(self, num_blocks: int, block_size: int, next_token=fake_next_token) -> None:
        self.block_size = block_size
        self.slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.next_token = next_token

    def run(self, output: SchedulerOutput) -> dict[str, list[int]]:
        bs = self.block_size
        # Write every request's new KV before anyone reads, as one batched forward does.
        for item in output.scheduled:
            for i, token in enumerate(item.token_ids):
                pos = item.num_computed_tokens + i
                self.slots[item.block_ids[pos // bs]][pos % bs] = token
        sampled: dict[str, list[int]] = {}
        for item in output.scheduled:
            if item.sample:
                end = item.num_computed_tokens + len(item.token_ids)
                seq = [item_slot(self.slots, item.block_ids, p, bs) for p in range(end)]
                assert None not in seq, f"{item.request_id} reads a slot never written"
                sampled[item.request_id] = self._verify(seq, item.num_draft_tokens)
        return sampled

    def _verify(self, seq: list[int], num_drafts: int) -> list[int]:
        """The token after each of the last 1 + num_drafts positions, kept while the next
        draft equals it (speculative decoding's greedy rule)."""
        first = len(seq) - num_drafts
        tokens = []
        for end in range(first, len(seq) + 1):
            token = self.next_token(seq[:end])
            tokens.append(token)
            if end == len(seq) or seq[end] != token:
                break
        return tokens


def item_slot(slots, block_ids, pos: int, bs: int):
    return slots[block_ids[pos // bs]][pos % bs]


def block_bytes(slots: list[int | None]) -> bytes:
    """A fake block's slots as the tier stores them (None, never written: 255)."""
    return bytes(255 if token is None else token for token in slots)


class Harness:
    """Drives a Scheduler with the fake model and checks invariants around every step.

    Time is a fake clock that moves one second per step: requests arrive at `now`, and
    lpm's age bound counts steps.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        next_token=fake_next_token,
        tier: HostTier | None = None,
        drafter: Callable[[Request], list[int]] | None = None,
    ) -> None:
        """`drafter`: speculative decoding's proposer, asked after each step for each
        running request's draft tokens."""
        self.config = config
        self.now = 0.0
        self.sched = Scheduler(config, clock=lambda: self.now, tier=tier)
        self.mgr = self.sched.kv_cache_manager
        self.model = FakePagedModel(config.num_blocks, config.block_size, next_token)
        self.next_token = next_token
        self.drafter = drafter
        self.outputs: list[SchedulerOutput] = []
        self.requests: dict[str, Request] = {}

    def add(
        self,
        request_id: str,
        prompt: Sequence[int],
        eos_token_ids: Collection[int] = frozenset(),
        cache_salt: str | None = None,
        priority: int = 0,
        queue_timeout: float | None = None,
        **params,
    ) -> Request:
        request = Request(
            request_id,
            prompt,
            SamplingParams(**params),
            eos_token_ids,
            cache_salt=cache_salt,
            arrival_time=self.now,
            priority=priority,
            queue_timeout=queue_timeout,
        )
        self.sched.add_request(request)
        self.requests[request_id] = request
        return request

    def step(self) -> SchedulerOutput:
        before = {
            r.request_id: (r.num_computed_tokens, len(r.all_token_ids)) for r in self.sched.running
        }
        before.update({r.request_id: (0, len(r.all_token_ids)) for r in self.sched.waiting})
        out = self.sched.schedule()
        for request in out.timed_out:  # only a request that never ran, past its deadline
            assert request.status is RequestStatus.FINISHED_QUEUE_TIMEOUT
            assert request.num_cached_tokens == -1 and request.queue_deadline <= self.now
            assert request.request_id in out.finished_ids
        self.check_schedule(out, before)
        self.move_tier_blocks()
        sampled = self.model.run(out)
        got = self.sched.update_from_output(out, sampled)
        assert {r.request_id for r in got} == set(sampled)
        self.outputs.append(out)
        self.check_state()
        if self.drafter is not None:
            for request in self.sched.running:
                request.spec_token_ids = self.drafter(request)
        self.now += 1.0
        return out

    def move_tier_blocks(self) -> None:
        """What the engine does between schedule() and the step: evicted blocks out to the
        tier (read before anything is written), brought-back blocks in."""
        tier = self.mgr.tier
        if tier is None:
            return
        offloads, loads = self.mgr.take_tier_moves()
        slots = self.model.slots
        for block_id, block_hash in offloads:
            tier.put(block_hash, block_bytes(slots[block_id]))
        for block_id, data in loads.items():
            slots[block_id] = [None if b == 255 else b for b in data]

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        assert not self.sched.has_unfinished_requests(), "requests left after max_steps"
        self.check_all_free()

    def check_schedule(self, out: SchedulerOutput, before: dict[str, tuple[int, int]]) -> None:
        cfg = self.config
        ids = [item.request_id for item in out.scheduled]
        assert len(ids) == len(set(ids)), "a request is scheduled twice in one step"
        assert not set(ids) & out.preempted_ids
        assert out.num_batched_tokens == sum(len(item.token_ids) for item in out.scheduled)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert self.sched.num_running <= cfg.max_num_seqs
        for item in out.scheduled:
            request = item.request
            num_computed, num_tokens = before[item.request_id]
            assert request.status is RequestStatus.RUNNING
            assert item.request_id == request.request_id
            assert len(item.token_ids) >= 1
            if num_computed:  # a running request continues where it stopped
                assert item.num_computed_tokens == num_computed
            else:  # an admitted request starts after its cached full blocks
                assert item.num_computed_tokens % cfg.block_size == 0
            end = item.num_computed_tokens + len(item.token_ids)
            k = item.num_draft_tokens
            known = item.token_ids[: len(item.token_ids) - k]
            assert known == request.all_token_ids[item.num_computed_tokens : end - k]
            assert end - k <= num_tokens
            assert item.sample == (end - k == num_tokens)
            if k:  # drafts ride only on a decode, within what the request may still emit
                assert len(known) == 1 and end - k == num_tokens
                max_len = min(
                    len(request.prompt_token_ids) + request.sampling_params.max_tokens,
                    cfg.max_model_len,
                )
                assert end + 1 <= max_len
            assert request.num_computed_tokens == end
            assert len(item.block_ids) * cfg.block_size >= end
            assert item.block_ids == self.mgr.get_block_ids(item.request_id)
        self.mgr.check_invariants()

    def check_state(self) -> None:
        self.mgr.check_invariants()
        block_size = self.config.block_size
        for request in self.sched.running:
            assert request.status is RequestStatus.RUNNING
            table = self.mgr.get_block_ids(request.request_id)
            assert len(table) * block_size >= request.num_computed_tokens
            # No block beyond what the computed tokens need: a rejected tail was freed.
            assert len(table) == -(-request.num_computed_tokens // block_size)
        for request in self.sched.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.num_computed_tokens == 0
            assert self.mgr.get_block_ids(request.request_id) == ()
        assert self.sched.num_running + self.sched.num_waiting == len(self.sched.requests)
        for request in self.requests.values():
            if request.is_finished:
                assert request.request_id not in self.sched.requests

    def check_all_free(self) -> None:
        """Every block is back in the free queue, but pinned ones (held for good)."""
        self.mgr.check_invariants()
        pinned = {b.block_id for b in self.mgr.block_pool.blocks if b.ref_cnt}
        assert len(pinned) == self.mgr.num_pinned_blocks
        assert self.mgr.num_free_blocks == self.config.num_blocks - len(pinned)
        free = set(range(self.config.num_blocks)) - pinned
        assert sorted(self.mgr.free_block_ids()) == sorted(free)

    def expected(self, request: Request) -> tuple[list[int], str]:
        return reference_generate(
            request.prompt_token_ids,
            request.sampling_params,
            request.eos_token_ids,
            self.config.max_model_len,
            self.next_token,
        )


def make_config(**overrides) -> SchedulerConfig:
    values = dict(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
        block_size=4,
        num_blocks=200,
    )
    values.update(overrides)
    return SchedulerConfig(**values)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def assert_outputs_match_reference(h: Harness) -> None:
    for request in h.requests.values():
        tokens, reason = h.expected(request)
        if request.finish_reason == "queue_timeout":
            assert request.output_token_ids == []
            continue
        if request.finish_reason == "abort":  # cut short: what it got is still right
            assert request.output_token_ids == tokens[: request.num_output_tokens]
            continue
        assert request.output_token_ids == tokens, request.request_id
        assert request.finish_reason == reason, request.request_id
