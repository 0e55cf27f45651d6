"""Continuous batching over the paged KV cache (vLLM v1 style).

Each step has one token budget (`max_num_batched_tokens`) shared by prefill
and decode. Running requests go first, in admission order: one decode token
each, or the next chunk of an unfinished prompt. Then waiting requests are
admitted while the budget and `max_num_seqs` allow, each starting from its
longest cached prefix: first-come first-served ("fcfs"), or longest cached
prefix first ("lpm", see `_schedule_waiting_ordered`). A prompt longer than the
budget left is prefilled in chunks over several steps.

When a running request cannot get a block, the most recently admitted running
request (with priorities: the least important, lowest `priority` value last) is
preempted by recompute: its blocks are freed and it goes back to the head of
`waiting`, to be recomputed later (mostly from cached blocks).

Per request: `priority` orders admission ahead of the policy (lower first), and a
queue deadline finishes a request that is still waiting, never scheduled, when it
passes (FINISHED_QUEUE_TIMEOUT, listed in the step's `timed_out`).

Bookkeeping convention: `schedule()` advances `num_computed_tokens` by the
tokens it schedules (the KV manager's contract: allocate, then advance), so
after `schedule()` a request counts this step's tokens as computed.
`update_from_output()` only appends the sampled tokens and applies the stop
rules. A request's next step computes `all_token_ids[num_computed_tokens:]`
(the last sampled token in decode), and samples when that reaches the end of
`all_token_ids`, so a resumed preempted request never re-samples a token it
already has.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Iterable
from itertools import count, islice

from kv_cache.block_pool import EventListener
from kv_cache.host_tier import HostTier
from kv_cache.hybrid import kv_cache_manager_for
from scheduler.config import SchedulerConfig, fits_context
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.stop_rules import append_tokens

_RUNNING = RequestStatus.RUNNING
# lpm ranks at most this many waiting requests per step (the oldest): ranking costs a
# prefix lookup each, and past this many the queue is long enough that age rules anyway.
LPM_WINDOW = 256


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_event_listener: EventListener | None = None,
        clock: Callable[[], float] = time.monotonic,
        tier: HostTier | None = None,
        state_tier: HostTier | None = None,
    ) -> None:
        """`kv_event_listener` hears each block the prefix cache stores or evicts (a
        replica publishes them to the router). `clock` is the one requests' arrival
        times are on (lpm's age bound compares them). `tier`: the prefix cache's second
        tier (kv_cache/host_tier.py), whose block moves the caller makes after each
        schedule() (`KVCacheManager.take_tier_moves`); `state_tier`: a model with
        recurrent layers keeps its snapshots' in another."""
        config.verify()
        self.config = config
        self._clock = clock
        # Without the cache there is no prefix to prefer: lpm would be FCFS with extra work.
        self._lpm = config.scheduling_policy == "lpm" and config.enable_prefix_caching
        self.kv_cache_manager = kv_cache_manager_for(
            config.kv_cache_groups,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            enable_caching=config.enable_prefix_caching,
            hash_algo=config.prefix_cache_hash,
            event_listener=kv_event_listener,
            tier=tier,
            state=config.state_group,
            state_tier=state_tier,
        )
        # A hybrid model's other groups' tables ride with each scheduled request, and with
        # recurrent layers what the step does with its state.
        self._group_tables = getattr(self.kv_cache_manager, "get_group_block_ids", None)
        self._state_step = (self.kv_cache_manager.take_state_step
                            if config.state_group is not None else None)  # fmt: skip
        self.requests: dict[str, Request] = {}  # unfinished: waiting + running
        # Arrival order; preempted requests go to the head.
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0
        self._finished_ids: set[str] = set()  # since the last schedule()
        # (queue deadline, tie-break, request) of requests that have one, earliest first;
        # entries of requests scheduled or finished since are skipped when they surface.
        self._deadlines: list[tuple[float, int, Request]] = []
        self._tiebreak = count()
        # Unfinished requests with a priority other than 0: while there are none, the
        # FCFS queue needs no sorting.
        self._num_prioritized = 0

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it could never run within the limits."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} is not a new request")
        self._check_fits(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.queue_deadline is not None:
            entry = (request.queue_deadline, next(self._tiebreak), request)
            heapq.heappush(self._deadlines, entry)
        if request.priority:
            self._num_prioritized += 1

    def _check_fits(self, request: Request) -> None:
        cfg = self.config
        num_prompt = request.num_prompt_tokens
        if not fits_context(num_prompt, 1, cfg.max_model_len):
            raise ValueError(
                f"prompt of {num_prompt} tokens leaves no room for an output token: "
                f"prompt + 1 must be <= max_model_len={cfg.max_model_len}"
            )
        # The KV cache holds every token but the last one sampled, so a request that runs
        # to its end needs this many tokens' worth of blocks at once (fewer under a window).
        max_len = min(num_prompt + request.sampling_params.max_tokens, cfg.max_model_len)
        needed_blocks = self.kv_cache_manager.max_blocks(max_len - 1, cfg.max_num_batched_tokens)
        # Pinned blocks never come free: a request must fit in the others.
        pinned = self.kv_cache_manager.num_pinned_blocks
        if needed_blocks > cfg.num_blocks - pinned:
            raise ValueError(
                f"request needs up to {needed_blocks} KV blocks ({max_len - 1} tokens: prompt "
                f"{num_prompt} + max_tokens {request.sampling_params.max_tokens} - 1, "
                f"block_size={cfg.block_size}) but the cache has num_blocks={cfg.num_blocks}"
                + (f", {pinned} of them pinned" if pinned else "")
            )

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests in any state; their blocks are freed at once. Unknown ids are ignored."""
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (aborts, among them the output processor's stop
        strings): frees their blocks."""
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        removed: list[Request] = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            # Waiting requests too: the manager keeps a looked-up request's block
            # hashes until free() (a no-op for a request it does not know).
            self.kv_cache_manager.free(request)
            request.status = status
            self._retire(request)
            removed.append(request)
        if removed:
            # One pass over each queue, however many requests were removed.
            self.running = [r for r in self.running if not r.is_finished]
            self.waiting = deque(r for r in self.waiting if not r.is_finished)

    def uncache_failed_step(self, output: SchedulerOutput) -> None:
        """Take the blocks a step that failed was to write out of the prefix cache (see
        `KVCacheManager.uncache_unwritten`); call it before aborting the step's requests."""
        for item in output.scheduled:
            self.kv_cache_manager.uncache_unwritten(item.request_id, item.num_computed_tokens)

    def _retire(self, request: Request) -> None:
        """Forget a finished request (its blocks are already freed; queues are fixed by the caller)."""
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)
        if request.priority:
            self._num_prioritized -= 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        scheduled: list[ScheduledRequest] = []
        preempted_ids: set[str] = set()
        max_tokens = self.config.max_num_batched_tokens
        budget = self._schedule_running(max_tokens, scheduled, preempted_ids)
        # After a preemption memory is short: admitting newcomers would only evict
        # the blocks the preempted request will want back.
        if not preempted_ids:
            budget = self._schedule_waiting(budget, scheduled)
        # After admission: a request that can run now runs, however late it is.
        timed_out = self._expire_waiting() if self._deadlines else []
        finished_ids, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(
            scheduled, finished_ids, max_tokens - budget, preempted_ids, timed_out
        )

    def _expire_waiting(self) -> list[Request]:
        """Finish the requests still waiting, never scheduled, whose queue deadline has
        passed (FINISHED_QUEUE_TIMEOUT). A preempted request has begun and is spared."""
        now = self._clock()
        deadlines = self._deadlines
        expired = []
        while deadlines and deadlines[0][0] <= now:
            request = heapq.heappop(deadlines)[2]
            if request.status is RequestStatus.WAITING:
                expired.append(request)
        if expired:
            self.finish_requests(
                [r.request_id for r in expired], RequestStatus.FINISHED_QUEUE_TIMEOUT
            )
        return expired

    def _schedule_running(
        self, budget: int, scheduled: list[ScheduledRequest], preempted_ids: set[str]
    ) -> int:
        # The per-step hot loop (one pass per running request): locals, no calls
        # besides the KV manager's.
        allocate = self.kv_cache_manager.allocate_slots
        block_table = self.kv_cache_manager.get_block_ids
        group_tables = self._group_tables
        state_step = self._state_step
        make = ScheduledRequest
        running = self.running
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            all_ids = request.all_token_ids
            num_tokens = len(all_ids)
            start = request.num_computed_tokens
            # 1 in decode (the last sampled token); the rest of the prompt in chunked prefill.
            num_new = num_tokens - start
            drafts = request.spec_token_ids
            if drafts:  # speculative decoding: the drafts ride after the last token
                request.spec_token_ids = []
                drafts = drafts[: self._draft_room(request, budget)] if num_new == 1 else []
                num_new += len(drafts)
            if num_new > budget:
                num_new = budget
            new_blocks = allocate(request, num_new)
            if new_blocks is None and drafts:  # memory is short: drop the drafts first
                num_new -= len(drafts)
                drafts = []
                new_blocks = allocate(request, num_new)
            while new_blocks is None:
                # Victims come from the part this loop has not reached yet, so nothing
                # already scheduled this step loses its blocks.
                victim = self._pop_victim(running, index)
                self._preempt(victim)
                preempted_ids.add(victim.request_id)
                if victim is request:
                    return budget
                new_blocks = allocate(request, num_new)
            end = start + num_new
            request.num_computed_tokens = end
            request_id = request.request_id
            scheduled.append(
                make(
                    request,
                    request_id,
                    all_ids[start:end] + drafts if drafts else all_ids[start:end],
                    start,
                    block_table(request_id),
                    end >= num_tokens,
                    len(new_blocks),
                    len(drafts),
                    group_tables(request_id) if group_tables else (),
                    state_step(request_id) if state_step else None,
                )
            )
            budget -= num_new
            index += 1
        return budget

    def _draft_room(self, request: Request, budget: int) -> int:
        """How many draft tokens a decoding request may verify this step: within the step's
        budget, and no more than the tokens it may still emit (each draft kept is an output
        token, and one more comes with them), so it never outgrows the blocks it was
        admitted for."""
        max_len = min(
            request.num_prompt_tokens + request.sampling_params.max_tokens,
            self.config.max_model_len,
        )
        return max(min(budget - 1, max_len - len(request.all_token_ids) - 1), 0)

    def _pop_victim(self, running: list[Request], index: int) -> Request:
        """Take the request to preempt out of `running[index:]` (index: the one asking for
        blocks): the last admitted; with priorities, the least important, the last
        admitted among equals (the asking request itself when it is that one)."""
        if not self._num_prioritized:
            return running.pop()
        pos = max(range(index, len(running)), key=lambda i: (running[i].priority, i))
        return running.pop(pos)

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        if (self._lpm or self._num_prioritized) and len(self.waiting) > 1:
            return self._schedule_waiting_ordered(budget, scheduled)
        mgr = self.kv_cache_manager
        waiting = self.waiting
        running = self.running
        max_num_seqs = self.config.max_num_seqs
        while waiting and budget > 0 and len(running) < max_num_seqs:
            request = waiting[0]
            hits, num_hit_tokens = mgr.get_computed_blocks(request)
            num_new = min(len(request.all_token_ids) - num_hit_tokens, budget)
            if mgr.allocate_slots(request, num_new, hits) is None:
                break  # FCFS: nobody overtakes the head of the queue
            waiting.popleft()
            budget -= self._admit(request, num_hit_tokens, num_new, scheduled)
        return budget

    def _schedule_waiting_ordered(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        """Admit in `_admission_order`; as in FCFS, the first request that does not get
        its blocks stops admission for this step.

        lpm: by longest cached prefix (SGLang's lpm): a request whose prefix the cache
        holds costs a fraction of a cold one, and is served before LRU evicts the prefix.
        Past the age bound a request goes in arrival order ahead of the others, so none
        waits forever.

        Requests sharing a prefix nobody has computed yet need no rule of their own (SGLang's
        in-batch dedup): blocks are cached when allocated, so a request admitted after the
        first one in the same step hits them; and a prompt still being prefilled takes
        all the budget left, so nobody is admitted beside its unfinished prefill to compute
        the same blocks twice."""
        mgr = self.kv_cache_manager
        running = self.running
        max_num_seqs = self.config.max_num_seqs
        admitted: set[str] = set()
        for request in self._admission_order():
            if budget <= 0 or len(running) >= max_num_seqs:
                break
            hits, num_hit_tokens = mgr.get_computed_blocks(request)
            num_new = min(len(request.all_token_ids) - num_hit_tokens, budget)
            if mgr.allocate_slots(request, num_new, hits) is None:
                break  # memory is short: a smaller request would only take what this one needs
            admitted.add(request.request_id)
            budget -= self._admit(request, num_hit_tokens, num_new, scheduled)
        if admitted:
            self.waiting = deque(r for r in self.waiting if r.request_id not in admitted)
        return budget

    def _admission_order(self) -> list[Request]:
        """The waiting requests in admission order: by priority, lowest first; within a
        priority, fcfs: by arrival; lpm (the oldest LPM_WINDOW requests only): those past
        the age bound by arrival, then the others by cached prefix, longest first."""
        if not self._lpm:
            return sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time))
        candidates = list(islice(self.waiting, LPM_WINDOW))
        oldest = self._clock() - self.config.age_bound_s
        num_cached = self.kv_cache_manager.num_cached_tokens

        def key(request: Request) -> tuple[int, bool, int, float]:
            if request.arrival_time < oldest:
                return (request.priority, False, 0, request.arrival_time)
            return (request.priority, True, -num_cached(request), request.arrival_time)

        return sorted(candidates, key=key)

    def _admit(
        self,
        request: Request,
        num_hit_tokens: int,
        num_new: int,
        scheduled: list[ScheduledRequest],
    ) -> int:
        """Move a request whose blocks were just allocated to `running`; its token count."""
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        request.status = _RUNNING
        self.running.append(request)
        scheduled.append(self._make_scheduled(request, num_new))
        return num_new

    def _make_scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        all_ids = request.all_token_ids
        request.num_computed_tokens = end
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        group_tables = self._group_tables
        return ScheduledRequest(
            request,
            request.request_id,
            all_ids[start:end],
            start,
            block_ids,
            end == len(all_ids),
            len(block_ids),  # just admitted: its whole table is new
            group_block_ids=group_tables(request.request_id) if group_tables else (),
            state=self._state_step(request.request_id) if self._state_step else None,
        )

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: free the blocks and requeue at the head of `waiting`."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ update

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[Request]:
        """Append the sampled tokens and apply the stop rules after each: eos and stop
        token ids, max_tokens, max_model_len, and a grammar the token completed. This is
        the one place a request finishes on its own (from outside: `finish_requests`,
        aborts).

        `sampled` maps request id -> its new tokens for every scheduled request with
        `sample=True` (requests finished since schedule(), e.g. aborted, are skipped):
        one token, or with k draft tokens scheduled, the drafts the runner kept and one
        more (1 to k + 1). A token that finishes the request drops the ones after it.
        The KV of rejected drafts is dropped: their blocks are freed. Finished requests
        free their blocks now and leave `running`. Returns the requests that got a
        token, finished ones included.
        """
        updated: list[Request] = []
        any_finished = False
        max_model_len = self.config.max_model_len
        for item in output.scheduled:
            if not item.sample:
                continue
            request = item.request
            if request.status is not _RUNNING:
                continue  # finished or aborted after schedule(): its token is dropped
            tokens = sampled.get(item.request_id)
            if not tokens or len(tokens) > 1 + item.num_draft_tokens:
                raise ValueError(f"no or too many sampled tokens for {item.request_id!r}")
            updated.append(request)
            status = append_tokens(request, tokens, max_model_len)
            if status is None and item.num_draft_tokens:
                # The last token appended has no KV yet; the rejected drafts' blocks go back.
                request.num_computed_tokens = len(request.all_token_ids) - 1
                self.kv_cache_manager.trim(request)
            if status is not None:
                self.kv_cache_manager.free(request)
                request.status = status
                self._retire(request)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        return updated
