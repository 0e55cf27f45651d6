"""pagedserve's /metrics before and after a run: why the numbers are what they are.

The mean batch per engine step comes from the iteration histograms (sum / count of the
observations made during the run), the hit rate from the prefix-cache counters. Servers
without pagedserve's metrics (llama-cpp-python, llama-server, transformers serve, the naive
baseline) give None.
"""

from __future__ import annotations

import httpx

PREFIX = "pagedserve:"
_SAMPLES = (
    "iteration_tokens_total_sum",
    "iteration_tokens_total_count",
    "iteration_requests_sum",
    "iteration_requests_count",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "num_preemptions_total",
    "prompt_tokens_total",
    "generation_tokens_total",
)


def parse_metrics(text: str) -> dict[str, float]:
    """The unlabelled `pagedserve:` samples of a Prometheus text page, by name sans prefix."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(PREFIX) or "{" in line:
            continue
        name, _, value = line.partition(" ")
        try:
            samples[name[len(PREFIX) :]] = float(value.split()[0])
        except (ValueError, IndexError):
            continue
    return samples


def scrape(base_url: str, timeout_s: float = 30.0) -> dict[str, float] | None:
    """pagedserve's counters now, or None when the server has no such /metrics."""
    try:
        response = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    samples = parse_metrics(response.text)
    return samples if "iteration_requests_count" in samples else None


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def metrics_delta(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float | None] | None:
    """What the server did between two scrapes: steps, mean batch, hit rate, preemptions."""
    if before is None or after is None:
        return None
    d = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in _SAMPLES}
    steps = d["iteration_requests_count"]
    return {
        "engine_steps": steps,
        "mean_requests_per_step": _ratio(d["iteration_requests_sum"], steps),
        "mean_tokens_per_step": _ratio(
            d["iteration_tokens_total_sum"], d["iteration_tokens_total_count"]
        ),
        "prefix_cache_hit_rate": _ratio(
            d["prefix_cache_hits_total"], d["prefix_cache_queries_total"]
        ),
        "prompt_tokens_computed": d["prompt_tokens_total"],
        "generation_tokens": d["generation_tokens_total"],
        "preemptions": d["num_preemptions_total"],
    }
