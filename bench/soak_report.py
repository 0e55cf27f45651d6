"""The soak's summary: outcomes counted, its verdict (`failures`: why it failed, empty when
it passed) and the text printed for it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any

from bench.soak_client import (
    OK,
    OUTCOMES,
    SERVER_ERROR,
    TRANSPORT,
    LoadOutcome,
)
from bench.soak_plan import SoakConfig

SAMPLES_KEPT = 5
# SIGTERM drains and exits 0 (server/shutdown.py); -SIGKILL means it ignored SIGTERM past
# the timeout, 1 that its engine died.
CLEAN_EXIT_CODE = 0


def summarize(
    cfg: SoakConfig,
    load: LoadOutcome,
    after: dict[str, Any],
    server: dict[str, Any],
    error_lines: list[str],
) -> dict[str, Any]:
    results = load.results
    outcomes = Counter(r.outcome for r in results)
    statuses = Counter(str(r.status) for r in results if r.status not in (None, 200))
    by_kind: dict[str, dict[str, int]] = {}
    for r in results:
        kind = by_kind.setdefault(r.kind, dict.fromkeys(OUTCOMES, 0))
        kind[r.outcome] += 1
    accepted = [r for r in results if r.malformed and r.outcome == OK]
    bad = [r for r in results if r.outcome in (SERVER_ERROR, TRANSPORT)] + accepted
    server = {
        **server,
        "errors_logged": len(error_lines),
        "error_lines": error_lines[:SAMPLES_KEPT],
    }
    summary = {
        "requests": len(results),
        "duration_s": round(load.duration_s, 2),
        "offered_rate": cfg.rate,
        "ok_per_s": round(outcomes[OK] / load.duration_s, 2) if load.duration_s else None,
        "arrivals_held_by_cap": load.held_by_cap,
        "outcomes": {name: outcomes[name] for name in OUTCOMES},
        "status_codes": dict(sorted(statuses.items())),
        "by_kind": dict(sorted(by_kind.items())),
        "malformed_accepted": len(accepted),
        "failure_samples": [f"#{r.index} {r.kind}: {r.status} {r.detail}" for r in bad][
            :SAMPLES_KEPT
        ],
        "after": after,
        "server": server,
        "config": {**asdict(cfg), "malformed_kinds": list(cfg.malformed_kinds)},
    }
    summary["failures"] = failures(summary)
    summary["passed"] = not summary["failures"]
    return summary


def failures(summary: dict[str, Any]) -> list[str]:
    """Why the soak failed; empty when it passed."""
    out, after, server = summary["outcomes"], summary["after"], summary["server"]
    reasons = []
    if out[SERVER_ERROR]:
        reasons.append(f"{out[SERVER_ERROR]} 5xx answers (503 excluded)")
    if out[TRANSPORT]:
        reasons.append(f"{out[TRANSPORT]} transport errors")
    if summary["malformed_accepted"]:
        reasons.append(f"{summary['malformed_accepted']} malformed requests answered 200")
    if not after["settled"]:
        reasons.append(
            f"not settled after {after['settle_s']} s: running {after['running']}, waiting "
            f"{after['waiting']}, KV cache usage {after['kv_cache_usage']}"
        )
    if after["health"] != 200:
        reasons.append(f"/health answered {after['health']} after the run")
    if server["errors_logged"]:
        reasons.append(f"{server['errors_logged']} error lines in the server log")
    if server["exit_code"] != CLEAN_EXIT_CODE:
        reasons.append(f"the server exited with {server['exit_code']} after SIGTERM")
    return reasons


# ------------------------------------------------------------------------------- output


def format_summary(s: dict[str, Any]) -> str:
    out, after, server = s["outcomes"], s["after"], s["server"]
    codes = ", ".join(f"{code}: {count}" for code, count in s["status_codes"].items())
    rate = f"{s['offered_rate']:g} req/s offered" if s["offered_rate"] else "all at once"
    lines = [
        f"soak: {s['requests']} requests in {s['duration_s']} s ({rate}, {s['ok_per_s']} ok/s; "
        f"{s['arrivals_held_by_cap']} arrivals held by the client cap)",
        "",
        "| outcome | count |",
        "|---|---:|",
        *(f"| {name} | {out[name]} |" for name in OUTCOMES),
        "",
        f"status codes: {codes or 'none but 200'}",
        "by kind: "
        + "; ".join(
            f"{kind} " + " ".join(f"{k}={v}" for k, v in counts.items() if v)
            for kind, counts in s["by_kind"].items()
        ),
        f"after the run: running {after['running']}, waiting {after['waiting']}, KV cache usage "
        f"{after['kv_cache_usage']} (settled: {after['settled']}, {after['settle_s']} s), "
        f"/health {after['health']}",
        f"engine requests finished: {after['engine_requests_finished']}",
        f"server: peak RSS {server['peak_rss_mib']} MiB (after start-up "
        f"{server['rss_start_mib']}, at the end {server['rss_end_mib']}), errors logged "
        f"{server['errors_logged']}, exit code {server['exit_code']} after SIGTERM "
        f"({server['stop_s']} s), log {server['log']}",
        f"machine: {server['machine']}; 1-min load average at start / end of the load: "
        f"{server['load_avg_1m'][0]} / {server['load_avg_1m'][1]}",
    ]
    lines += [f"  failure: {x}" for x in s["failure_samples"]]
    lines += [f"  log: {x}" for x in server["error_lines"]]
    verdict = "PASS" if s["passed"] else "FAIL: " + "; ".join(s["failures"])
    return "\n".join([*lines, f"result: {verdict}"])
