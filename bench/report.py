"""A load run's results as one JSON record, and records as a markdown table."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.loadgen import LoadRun, RequestResult

MAX_ERROR_MESSAGES = 5


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 3)


def _sum_known(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def summarize(
    run: LoadRun,
    count_prompt_tokens: Callable[[RequestResult], int] | None = None,
    **context: Any,
) -> dict[str, Any]:
    """The run's record. `count_prompt_tokens(result)` counts a request's prompt locally,
    used when the server reports no usage; `context` (workload, concurrency, ...) goes first."""
    ok = [r for r in run.results if r.ok]
    failed = [r for r in run.results if not r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = _prompt_tokens(run.results, count_prompt_tokens)
    duration = max(run.duration, 1e-9)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [gap for r in ok for gap in r.itl]
    latencies = [r.latency for r in ok]
    return {
        **context,
        "model": run.model,
        "requests": len(ok),
        "errors": len(failed),
        "error_messages": [r.error for r in failed[:MAX_ERROR_MESSAGES]],
        "duration_s": round(run.duration, 3),
        "request_throughput": round(len(ok) / duration, 4),
        "output_throughput": round(output_tokens / duration, 3),
        "total_token_throughput": round((output_tokens + prompt_tokens) / duration, 3),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cached_tokens": _sum_known([r.cached_tokens for r in ok]),
        "ttft_ms": {f"p{q}": _ms(percentile(ttfts, q)) for q in (50, 90, 99)},
        "itl_ms": {f"p{q}": _ms(percentile(itls, q)) for q in (50, 99)},
        "e2e_ms": {f"p{q}": _ms(percentile(latencies, q)) for q in (50, 99)},
    }


def _prompt_tokens(
    results: list[RequestResult], count_prompt_tokens: Callable[[RequestResult], int] | None
) -> int:
    """Prompt tokens of the successful requests: the server's count, else a local one."""
    total = 0
    for r in results:
        if not r.ok:
            continue
        if r.prompt_tokens is not None:
            total += r.prompt_tokens
        elif count_prompt_tokens is not None:
            total += count_prompt_tokens(r)
    return total


def ttft_samples(run: LoadRun) -> list[float]:
    return [r.ttft for r in run.results if r.ok and r.ttft is not None]


# -------------------------------------------------------------------------------- tables

COLUMNS: tuple[tuple[str, str, Callable[[dict[str, Any]], Any]], ...] = (
    ("server", "s", lambda r: r.get("server", "")),
    ("workload", "s", lambda r: r.get("workload", "")),
    ("conc", "s", lambda r: r.get("concurrency") or "inf"),
    ("ok/err", "s", lambda r: f"{r['requests']}/{r['errors']}"),
    ("out tok/s", ".1f", lambda r: r["output_throughput"]),
    ("total tok/s", ".0f", lambda r: r["total_token_throughput"]),
    ("TTFT p50 ms", ".0f", lambda r: r["ttft_ms"]["p50"]),
    ("TTFT p99 ms", ".0f", lambda r: r["ttft_ms"]["p99"]),
    ("ITL p50 ms", ".1f", lambda r: r["itl_ms"]["p50"]),
    ("e2e p50 s", ".2f", lambda r: _s(r["e2e_ms"]["p50"])),
    ("cached tok", "s", lambda r: r["cached_tokens"] if r["cached_tokens"] is not None else "-"),
    ("batch/step", ".1f", lambda r: _metric(r, "mean_requests_per_step")),
    ("hit rate", ".0%", lambda r: _metric(r, "prefix_cache_hit_rate")),
    ("load", ".1f", lambda r: r.get("load_avg_1m")),
)


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


def _metric(record: dict[str, Any], name: str) -> float | None:
    metrics = record.get("server_metrics")
    return metrics.get(name) if metrics else None


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    return format(value, fmt) if fmt != "s" else str(value)


def markdown_table(records: Sequence[dict[str, Any]]) -> str:
    """One row per record, the columns a reader compares servers on."""
    head = "| " + " | ".join(name for name, _, _ in COLUMNS) + " |"
    rule = "|" + "|".join("---" if fmt == "s" else "---:" for _, fmt, _ in COLUMNS) + "|"
    rows = [
        "| " + " | ".join(_cell(get(r), fmt) for _, fmt, get in COLUMNS) + " |" for r in records
    ]
    return "\n".join([head, rule, *rows])


def publish(lines: Sequence[str], out: Path | None) -> None:
    """Print a markdown report and, when asked, write it to `out` (bench scripts' --out)."""
    report = "\n".join(lines) + "\n"
    print(report)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
