"""Prometheus metrics (vLLM's names, prefix `pagedserve:`) and the periodic stats log line.

Each `ServerMetrics` has its own `CollectorRegistry`, so several apps in one
process (the tests) never collide. The engine thread updates the metrics:
`on_step` after every step from the engine's cumulative `EngineStats` (counters
advance by deltas), `on_request_done` when a request finishes or is aborted.
prometheus_client is thread-safe, and /metrics reads from the event loop.

The pool's blocks by state (`kv_cache_blocks{tier,state}`, `kv_cache_num_blocks{tier}`)
are read when /metrics is scraped, from the counts the engine thread last published
(`watch_kv_blocks`; else the last step's): the pool also changes between steps (aborts,
a cache reset) and before the first one. `tier="pool"` is the device's block pool;
`tier="host"` the second tier's file (with --kv-offload-bytes: its slots holding a block are
"cached", the others "free"), and `external_prefix_cache_hits` counts the prompt tokens
brought back from it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.stats import EngineStats
from kv_cache import BlockCounts

logger = logging.getLogger("server.stats")

# No `*_created` series next to every counter (vLLM turns them off too).
disable_created_metrics()

PREFIX = "pagedserve:"
# error: its engine step failed; queue_timeout: it waited past its queue timeout, unscheduled.
FINISH_REASONS = ("stop", "length", "abort", "error", "queue_timeout")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ITERATION_REQUEST_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                           5.0, 10.0, 30.0)  # fmt: skip

POOL_TIER = "pool"  # the device's KV block pool
HOST_TIER = "host"  # the second tier's file (--kv-offload-bytes)
BLOCK_STATES = ("free", "cached", "in_use")  # BlockCounts' fields, as label values

# The cumulative EngineStats fields mirrored as Prometheus counters.
_CUMULATIVE = ("prefix_cache_queries", "prefix_cache_hits", "tier_hits", "num_preemptions",
               "prompt_tokens", "generation_tokens", "spec_num_drafts", "spec_num_draft_tokens",
               "spec_num_accepted_tokens")  # fmt: skip


@dataclass
class RequestTimes:
    """One engine request's timeline (time.monotonic seconds), kept by the engine thread."""

    arrival: float
    queue_timeout: float | None = None  # seconds, as the request asked (for its error)
    first_token: float | None = None
    num_tokens: int = 0


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.counters = {
            "prefix_cache_queries": Counter(
                PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                registry=r),
            "prefix_cache_hits": Counter(
                PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                registry=r),
            "tier_hits": Counter(
                PREFIX + "external_prefix_cache_hits",
                "Prompt tokens brought back from the host KV tier (then counted as prefix "
                "cache hits).", registry=r),
            "num_preemptions": Counter(
                PREFIX + "num_preemptions", "Requests preempted (blocks freed, recomputed later).",
                registry=r),
            "prompt_tokens": Counter(
                PREFIX + "prompt_tokens",
                "Prompt tokens of prefilled requests, cache hits included (vLLM's count).",
                registry=r),
            "generation_tokens": Counter(
                PREFIX + "generation_tokens", "Tokens sampled.", registry=r),
            "spec_num_drafts": Counter(
                PREFIX + "spec_decode_num_drafts",
                "Speculative decoding: verifications (a request's step with draft tokens).",
                registry=r),
            "spec_num_draft_tokens": Counter(
                PREFIX + "spec_decode_num_draft_tokens",
                "Speculative decoding: draft tokens verified.", registry=r),
            "spec_num_accepted_tokens": Counter(
                PREFIX + "spec_decode_num_accepted_tokens",
                "Speculative decoding: draft tokens kept.", registry=r),
        }  # fmt: skip
        self.spec_accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens kept, by position in the draft (0: first).",
            ["position"], registry=r)  # fmt: skip
        self.kv_cache_usage = Gauge(
            PREFIX + "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", registry=r
        )
        self.num_running = Gauge(
            PREFIX + "num_requests_running", "Requests in the running batch.", registry=r
        )
        self.num_waiting = Gauge(
            PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.", registry=r
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        for reason in FINISH_REASONS:
            self.request_success.labels(finished_reason=reason)  # export zeros from the start
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token.",
            buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds", "Time per output token after the first.",
            buckets=TPOT_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival to finish.",
            buckets=E2E_BUCKETS, registry=r)  # fmt: skip
        self.iteration_tokens = Histogram(
            PREFIX + "iteration_tokens_total", "Tokens computed per engine step.",
            buckets=ITERATION_TOKEN_BUCKETS, registry=r)  # fmt: skip
        self.iteration_requests = Histogram(
            PREFIX + "iteration_requests", "Requests batched per engine step.",
            buckets=ITERATION_REQUEST_BUCKETS, registry=r)  # fmt: skip
        self.grammar_compile = Histogram(
            PREFIX + "grammar_compile_seconds",
            "Time to compile a structured-output grammar (cache misses only).",
            buckets=GRAMMAR_COMPILE_BUCKETS, registry=r)  # fmt: skip
        self.grammar_requests = Counter(
            PREFIX + "grammar_requests", "Structured-output grammars asked for, by cache result.",
            ["cache"], registry=r)  # fmt: skip
        for result in ("hit", "miss"):
            self.grammar_requests.labels(cache=result)
        self._last = EngineStats()
        self._kv_blocks_source: Callable[[], BlockCounts | None] | None = None
        r.register(_KVBlocksCollector(self.kv_blocks, lambda: self._last))

    def set_execution_plan(self, plan: dict[str, str]) -> None:
        """The engine's execution plan as one info series (`engine.execution_plan`'s
        `info()`: device, dtype, attention backend, layer ops, weights...), set at start-up."""
        Info(f"{PREFIX}execution_plan", "How a step executes here (the start-up line's plan).",
             registry=self.registry).info(plan)  # fmt: skip

    def watch_kv_blocks(self, source: Callable[[], BlockCounts | None]) -> None:
        """Read the pool's block counts from `source` at each scrape. It must return what the
        engine thread published (an immutable `BlockCounts`), never read the pool itself."""
        self._kv_blocks_source = source

    def kv_blocks(self) -> BlockCounts | None:
        """The latest block counts: the watched source's, else the last step's."""
        counts = self._kv_blocks_source() if self._kv_blocks_source is not None else None
        if counts is None:
            counts = self._last.kv_blocks
        return counts if counts.total else None  # all zeros: no pool known yet

    def on_grammar(self, cache_hit: bool, seconds: float) -> None:
        """A grammar was looked up (any thread): a hit, or a miss that took `seconds`."""
        self.grammar_requests.labels(cache="hit" if cache_hit else "miss").inc()
        if not cache_hit:
            self.grammar_compile.observe(seconds)

    # -- engine thread ---------------------------------------------------------------

    def on_step(self, stats: EngineStats) -> None:
        for name in _CUMULATIVE:
            now, before = getattr(stats, name), getattr(self._last, name)
            # A counter that went down was reset (e.g. prefix-cache stats): count from 0.
            delta = now - before if now >= before else now
            if delta:
                self.counters[name].inc(delta)
        before = self._last.spec_accepted_per_pos
        for pos, now in enumerate(stats.spec_accepted_per_pos):
            if delta := now - (before[pos] if pos < len(before) else 0):
                self.spec_accepted_per_pos.labels(position=str(pos)).inc(delta)
        self.set_gauges(stats.num_running, stats.num_waiting, stats.kv_cache_usage)
        if stats.num_steps != self._last.num_steps:
            self.iteration_tokens.observe(stats.last_step_tokens)
            self.iteration_requests.observe(stats.last_step_seqs)
        self._last = EngineStats(**vars(stats))

    def set_gauges(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        self.kv_cache_usage.set(kv_cache_usage)

    def on_request_done(self, times: RequestTimes, finish_reason: str, now: float) -> None:
        self.request_success.labels(finished_reason=finish_reason).inc()
        self.e2e.observe(now - times.arrival)
        if times.first_token is not None and times.num_tokens > 1:
            self.tpot.observe((now - times.first_token) / (times.num_tokens - 1))

    def on_first_token(self, times: RequestTimes) -> None:
        if times.first_token is not None:
            self.ttft.observe(times.first_token - times.arrival)

    # -- event loop -------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _KVBlocksCollector(Collector):
    """The block gauges, from one `BlockCounts` per scrape, so the states add up to the
    total in every scrape (three separate gauges could each be read at another moment)."""

    def __init__(
        self, counts: Callable[[], BlockCounts | None], stats: Callable[[], EngineStats]
    ) -> None:
        self._counts = counts
        self._stats = stats  # the last step's: the host tier's blocks

    def collect(self) -> Iterator[GaugeMetricFamily]:
        by_state = GaugeMetricFamily(
            PREFIX + "kv_cache_blocks",
            "KV cache blocks by state: free (holding nothing reusable), cached (free, still "
            "holding a reusable prefix; evicted least recently used first), in_use.",
            labels=["tier", "state"],
        )
        total = GaugeMetricFamily(
            PREFIX + "kv_cache_num_blocks", "KV cache blocks in the tier.", labels=["tier"]
        )
        counts = self._counts()
        if counts is not None:
            for state in BLOCK_STATES:
                by_state.add_metric([POOL_TIER, state], getattr(counts, state))
            total.add_metric([POOL_TIER], counts.total)
        stats = self._stats()
        if stats.tier_num_blocks:  # the host tier: its slots hold a block or nothing
            held = stats.tier_blocks
            by_state.add_metric([HOST_TIER, "cached"], held)
            by_state.add_metric([HOST_TIER, "free"], stats.tier_num_blocks - held)
            by_state.add_metric([HOST_TIER, "in_use"], 0)
            total.add_metric([HOST_TIER], stats.tier_num_blocks)
        by_group = GaugeMetricFamily(
            PREFIX + "kv_cache_group_blocks_in_use",
            "A hybrid model's in-use KV blocks by KV cache group (layers of one attention "
            "kind: full, or a sliding window of W tokens, which holds about W / block_size "
            "blocks a request); absent for a model of one group.",
            labels=["group", "attention"],
        )
        for group in counts.groups if counts is not None else ():
            by_group.add_metric([str(group.group), group.attention], group.in_use)
        slots = GaugeMetricFamily(
            PREFIX + "state_slots",
            "A linear-attention model's state slots by state: free, cached (a prefix cache "
            "snapshot of a state, evicted least recently used first), in_use (running "
            "requests' states and snapshots being written); absent for other models.",
            labels=["state"],
        )
        states = counts.states if counts is not None else None
        for state in BLOCK_STATES if states is not None else ():
            slots.add_metric([state], getattr(states, state))
        yield by_state
        yield total
        yield by_group
        yield slots


class StatsLogger:
    """A log line every `interval_s` while the engine is busy: throughput, queues, caches.

    When the engine goes idle the last partial window is logged, and the next busy
    period starts a fresh window (an idle hour must not dilute the throughput).
    """

    def __init__(self, interval_s: float = 5.0, clock=time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last_time = clock()
        self._last = EngineStats()
        self._idle = True

    def maybe_log(self, stats: EngineStats) -> str | None:
        """Call after each step; returns the line when one was logged."""
        now = self._clock()
        if self._idle:  # the first step of a busy period opens the window
            self._idle = False
            self._last_time = now
            return None
        if now - self._last_time < self.interval_s:
            return None
        return self._log(stats, now)

    def on_idle(self, stats: EngineStats) -> str | None:
        """Call when the engine has nothing left to do: logs the last partial window."""
        if self._idle:
            return None
        self._idle = True
        line = None
        if stats.num_steps != self._last.num_steps:
            line = self._log(stats, self._clock())
        self._last = EngineStats(**vars(stats))  # the next window counts from here
        return line

    def _log(self, stats: EngineStats, now: float) -> str:
        line = format_stats_line(self._last, stats, max(now - self._last_time, 1e-3))
        self._last_time, self._last = now, EngineStats(**vars(stats))
        logger.info(line)
        return line


def format_stats_line(before: EngineStats, now: EngineStats, elapsed_s: float) -> str:
    prompt_tps = max(now.prompt_tokens - before.prompt_tokens, 0) / elapsed_s
    gen_tps = max(now.generation_tokens - before.generation_tokens, 0) / elapsed_s
    queries = now.prefix_cache_queries - before.prefix_cache_queries
    hits = now.prefix_cache_hits - before.prefix_cache_hits
    hit_rate = hits / queries if queries > 0 else 0.0
    return (
        f"prompt throughput: {prompt_tps:.1f} tok/s, generation throughput: {gen_tps:.1f} tok/s, "
        f"running: {now.num_running}, waiting: {now.num_waiting}, "
        f"KV cache usage: {now.kv_cache_usage:.1%}, prefix cache hit rate: {hit_rate:.1%}"
    )
