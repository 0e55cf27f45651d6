"""ServerMetrics (deltas of the engine's cumulative stats) and the periodic stats line."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.stats import EngineStats
from kv_cache import BlockCounts
from server.metrics import RequestTimes, ServerMetrics, StatsLogger


def samples(metrics: ServerMetrics) -> dict:
    body, _ = metrics.render()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def test_counters_follow_cumulative_stats_by_deltas():
    m = ServerMetrics()
    m.on_step(EngineStats(prompt_tokens=10, generation_tokens=1, prefix_cache_queries=10,
                          num_steps=1, last_step_tokens=10, last_step_seqs=1))  # fmt: skip
    m.on_step(EngineStats(prompt_tokens=10, generation_tokens=4, prefix_cache_queries=26,
                          prefix_cache_hits=16, num_preemptions=1, num_running=3, num_waiting=2,
                          kv_cache_usage=0.25, num_steps=2, last_step_tokens=3,
                          last_step_seqs=3))  # fmt: skip
    s = samples(m)
    assert s[("pagedserve:prompt_tokens_total", ())] == 10
    assert s[("pagedserve:generation_tokens_total", ())] == 4
    assert s[("pagedserve:prefix_cache_queries_total", ())] == 26
    assert s[("pagedserve:prefix_cache_hits_total", ())] == 16
    assert s[("pagedserve:num_preemptions_total", ())] == 1
    assert s[("pagedserve:num_requests_running", ())] == 3
    assert s[("pagedserve:num_requests_waiting", ())] == 2
    assert s[("pagedserve:kv_cache_usage_perc", ())] == 0.25
    assert s[("pagedserve:iteration_tokens_total_sum", ())] == 13
    assert s[("pagedserve:iteration_requests_count", ())] == 2
    assert s[("pagedserve:iteration_requests_bucket", (("le", "1.0"),))] == 1


def test_a_counter_that_went_down_counts_again_from_zero():
    m = ServerMetrics()
    m.on_step(EngineStats(prefix_cache_queries=100, num_steps=1))
    m.on_step(EngineStats(prefix_cache_queries=30, num_steps=2))  # stats were reset
    assert samples(m)[("pagedserve:prefix_cache_queries_total", ())] == 130


def test_no_new_step_no_histogram_sample():
    m = ServerMetrics()
    stats = EngineStats(num_steps=1, last_step_tokens=5, last_step_seqs=1)
    m.on_step(stats)
    m.on_step(stats)
    assert samples(m)[("pagedserve:iteration_tokens_total_count", ())] == 1


def test_request_lifetimes():
    m = ServerMetrics()
    times = RequestTimes(arrival=10.0, first_token=10.5, num_tokens=5)
    m.on_first_token(times)
    m.on_request_done(times, "length", now=12.5)
    m.on_request_done(RequestTimes(arrival=11.0), "abort", now=11.2)
    s = samples(m)
    assert s[("pagedserve:time_to_first_token_seconds_sum", ())] == 0.5
    assert s[("pagedserve:time_per_output_token_seconds_sum", ())] == 0.5  # 2 s / 4 tokens
    assert s[("pagedserve:time_per_output_token_seconds_count", ())] == 1
    assert s[("pagedserve:e2e_request_latency_seconds_count", ())] == 2
    assert s[("pagedserve:request_success_total", (("finished_reason", "length"),))] == 1
    assert s[("pagedserve:request_success_total", (("finished_reason", "abort"),))] == 1
    assert s[("pagedserve:request_success_total", (("finished_reason", "stop"),))] == 0


def test_each_metrics_object_has_its_own_registry():
    a, b = ServerMetrics(), ServerMetrics()
    a.on_step(EngineStats(generation_tokens=7, num_steps=1))
    assert samples(a)[("pagedserve:generation_tokens_total", ())] == 7
    assert samples(b)[("pagedserve:generation_tokens_total", ())] == 0


def block_samples(metrics: ServerMetrics) -> dict:
    return {
        key: value
        for key, value in samples(metrics).items()
        if key[0] in ("pagedserve:kv_cache_blocks", "pagedserve:kv_cache_num_blocks")
    }


def test_block_gauges_by_state_and_tier():
    m = ServerMetrics()
    assert block_samples(m) == {}  # no pool known yet: the families have no samples
    m.on_step(EngineStats(kv_blocks=BlockCounts(free=5, cached=2, in_use=1), num_steps=1))
    assert block_samples(m) == {
        ("pagedserve:kv_cache_blocks", (("state", "free"), ("tier", "pool"))): 5,
        ("pagedserve:kv_cache_blocks", (("state", "cached"), ("tier", "pool"))): 2,
        ("pagedserve:kv_cache_blocks", (("state", "in_use"), ("tier", "pool"))): 1,
        ("pagedserve:kv_cache_num_blocks", (("tier", "pool"),)): 8,
    }
    # vLLM's series keep their names and their (lack of) labels.
    assert ("pagedserve:kv_cache_usage_perc", ()) in samples(m)


def test_the_host_tier_has_its_blocks_and_its_hits():
    m = ServerMetrics()
    pool = BlockCounts(free=5, cached=2, in_use=1)
    m.on_step(EngineStats(kv_blocks=pool, num_steps=1, tier_hits=32, tier_blocks=3,
                          tier_num_blocks=10))  # fmt: skip
    got = block_samples(m)
    assert got[("pagedserve:kv_cache_blocks", (("state", "cached"), ("tier", "host")))] == 3
    assert got[("pagedserve:kv_cache_blocks", (("state", "free"), ("tier", "host")))] == 7
    assert got[("pagedserve:kv_cache_num_blocks", (("tier", "host"),))] == 10
    assert samples(m)[("pagedserve:external_prefix_cache_hits_total", ())] == 32
    m.on_step(EngineStats(kv_blocks=pool, num_steps=2, tier_hits=48, tier_blocks=4,
                          tier_num_blocks=10))  # fmt: skip
    assert samples(m)[("pagedserve:external_prefix_cache_hits_total", ())] == 48
    none = ServerMetrics()  # no tier: no host series
    none.on_step(EngineStats(kv_blocks=pool, num_steps=1))
    assert all(("tier", "host") not in labels for _, labels in block_samples(none))


def test_a_watched_source_is_read_at_each_scrape():
    """Between steps (an abort, a cache reset) the engine publishes new counts that no
    on_step carries: the scrape reads them."""
    m = ServerMetrics()
    m.on_step(EngineStats(kv_blocks=BlockCounts(free=5, cached=2, in_use=1), num_steps=1))
    published = [BlockCounts(free=6, cached=2, in_use=0)]
    m.watch_kv_blocks(lambda: published[0])
    key = ("pagedserve:kv_cache_blocks", (("state", "in_use"), ("tier", "pool")))
    assert block_samples(m)[key] == 0
    published[0] = BlockCounts(free=0, cached=0, in_use=8)
    assert block_samples(m)[key] == 8


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_stats_line_every_interval_while_busy():
    clock = FakeClock()
    log = StatsLogger(interval_s=5.0, clock=clock)
    clock.now = 100.0  # a long idle start must not dilute the first window
    assert log.maybe_log(EngineStats(num_steps=1, prompt_tokens=100)) is None
    clock.now = 102.0
    assert log.maybe_log(EngineStats(num_steps=2, prompt_tokens=100, generation_tokens=10)) is None
    clock.now = 105.0
    line = log.maybe_log(
        EngineStats(num_steps=3, prompt_tokens=100, generation_tokens=50, num_running=2,
                    num_waiting=1, kv_cache_usage=0.5, prefix_cache_queries=100,
                    prefix_cache_hits=25)
    )  # fmt: skip
    assert line == (
        "prompt throughput: 20.0 tok/s, generation throughput: 10.0 tok/s, running: 2, "
        "waiting: 1, KV cache usage: 50.0%, prefix cache hit rate: 25.0%"
    )


def test_going_idle_logs_the_partial_window_once():
    clock = FakeClock()
    log = StatsLogger(interval_s=5.0, clock=clock)
    log.maybe_log(EngineStats(num_steps=1, generation_tokens=1))
    clock.now = 2.0
    line = log.on_idle(EngineStats(num_steps=5, generation_tokens=9))
    assert line is not None and "generation throughput: 4.5 tok/s" in line
    assert log.on_idle(EngineStats(num_steps=5, generation_tokens=9)) is None
