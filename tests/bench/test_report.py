"""The JSON record, percentiles, /metrics deltas, the markdown table and the plots."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from bench.loadgen import LoadRun, RequestResult
from bench.report import markdown_table, percentile, summarize
from bench.server_metrics import metrics_delta, parse_metrics


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = [0.3, 5.0, 1.2, 9.9, 0.01, 4.4, 4.4]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], q) is None


def ok(ttft: float, latency: float, out: int, prompt: int | None = None, cached=None):
    return RequestResult(True, latency=latency, ttft=ttft, itl=[0.01] * (out - 1),
                         output_tokens=out, prompt_tokens=prompt, cached_tokens=cached,
                         prompt="p" * 7)  # fmt: skip


def test_summarize_counts_throughput_and_latencies():
    results = [ok(0.1, 1.0, 10, 100, 50), ok(0.3, 2.0, 10, 100, 0)]
    results += [RequestResult(False, error=f"HTTP 500: boom {i}") for i in range(7)]
    r = summarize(LoadRun(results, duration=4.0, model="m"), lambda res: 1, workload="w")
    assert r["workload"] == "w" and r["model"] == "m"
    assert (r["requests"], r["errors"]) == (2, 7)
    assert r["error_messages"] == [f"HTTP 500: boom {i}" for i in range(5)]
    assert (r["output_tokens"], r["prompt_tokens"], r["cached_tokens"]) == (20, 200, 50)
    assert r["request_throughput"] == 0.5
    assert r["output_throughput"] == 5.0 and r["total_token_throughput"] == 55.0
    assert r["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert r["e2e_ms"]["p99"] == pytest.approx(1990.0)
    assert r["itl_ms"]["p50"] == pytest.approx(10.0)


def test_prompt_tokens_fall_back_to_the_local_count_without_usage():
    results = [ok(0.1, 1.0, 3), ok(0.1, 1.0, 3, prompt=40)]
    r = summarize(LoadRun(results, 1.0, None), lambda res: len(res.prompt))
    assert r["prompt_tokens"] == 7 + 40
    assert r["cached_tokens"] is None  # no server reported it: unknown, not zero


METRICS_PAGE = """# HELP pagedserve:iteration_requests Requests batched per engine step.
pagedserve:iteration_requests_bucket{{le="1.0"}} 3.0
pagedserve:iteration_requests_count {count}
pagedserve:iteration_requests_sum {reqs}
pagedserve:iteration_tokens_total_count {count}
pagedserve:iteration_tokens_total_sum {toks}
pagedserve:prefix_cache_queries_total {queries}
pagedserve:prefix_cache_hits_total {hits}
pagedserve:request_success_total{{finished_reason="length"}} 4.0
other_metric 5.0
"""


def page(**values: float) -> str:
    return METRICS_PAGE.format(**values)


def test_metrics_delta_gives_the_mean_batch_and_hit_rate_of_the_run():
    before = parse_metrics(page(count=10, reqs=10, toks=100, queries=50, hits=0))
    after = parse_metrics(page(count=30, reqs=90, toks=300, queries=250, hits=150))
    assert "request_success_total" not in before and "other_metric" not in before
    delta = metrics_delta(before, after)
    assert delta["engine_steps"] == 20
    assert delta["mean_requests_per_step"] == 4.0
    assert delta["mean_tokens_per_step"] == 10.0
    assert delta["prefix_cache_hit_rate"] == 0.75
    assert metrics_delta(None, after) is None
    idle = metrics_delta(before, before)
    assert idle["mean_requests_per_step"] is None and idle["prefix_cache_hit_rate"] is None


def test_markdown_table_has_a_row_per_record():
    rec = summarize(LoadRun([ok(0.1, 1.0, 4, 10)], 1.0, "m"), server="naive", workload="unique",
                    concurrency=8)  # fmt: skip
    rec["server_metrics"] = {"mean_requests_per_step": 6.5, "prefix_cache_hit_rate": 0.5}
    lines = markdown_table(
        [rec, {**rec, "server": "llama-cpp-python", "server_metrics": None}]
    ).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| server | workload | conc |")
    assert lines[2].startswith("| naive | unique | 8 | 1/0 | 4.0 |")
    assert "| 6.5 | 50% |" in lines[2] and "| - | - |" in lines[3]


def test_plots_are_written_or_matplotlib_is_named(tmp_path: Path):
    from bench.plots import plot_sweep, plot_ttft_cdf

    records = [
        {"server": s, "concurrency": c, "output_throughput": c * k, "ttft_ms": {"p50": 10.0 * c}}
        for s, k in (("a", 1.0), ("b", 2.0))
        for c in (1, 8, 32)
    ]
    if importlib.util.find_spec("matplotlib") is None:
        with pytest.raises(SystemExit, match="matplotlib"):
            plot_ttft_cdf({"a": [0.1]}, tmp_path / "cdf.png", "t")
        return
    cdf = plot_ttft_cdf({"a": [0.1, 0.2, 0.5], "b": [1.0, 2.0]}, tmp_path / "cdf.png", "t")
    sweep = plot_sweep(records, tmp_path / "sub" / "sweep.png", "t")
    for path in (cdf, sweep):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
