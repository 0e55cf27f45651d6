"""The soak's checks of the server after the load: /metrics settled (nothing running,
waiting or holding a KV block), its memory, /health and the errors in its log.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx

from bench.server_metrics import parse_metrics

# Log lines that mean the server hit something it did not expect (levels are upper case in
# both uvicorn's and pagedserve's formats; an access line's "Internal Server Error" is not).
ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback \(most recent call last\)")


def server_gauges(base_url: str) -> dict[str, Any]:
    """Running, waiting, KV usage and finished engine requests by reason, from /metrics."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=30).text
    except httpx.HTTPError:  # the server is gone: nothing is known, nothing is settled
        text = ""
    samples = parse_metrics(text)
    finished = {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r'^pagedserve:request_success_total\{finished_reason="(\w+)"\} (\S+)$', text, re.M
        )
    }
    return {
        "running": samples.get("num_requests_running"),
        "waiting": samples.get("num_requests_waiting"),
        "kv_cache_usage": samples.get("kv_cache_usage_perc"),
        "engine_requests_finished": finished,
    }


def wait_settled(base_url: str, timeout_s: float) -> dict[str, Any]:
    """Poll /metrics until nothing runs, waits or holds a KV block (cached-but-free blocks
    are free: the usage gauge counts blocks some request holds), at most `timeout_s`."""
    start = time.monotonic()
    while True:
        gauges = server_gauges(base_url)
        settled = gauges["running"] == 0 and gauges["waiting"] == 0
        settled = settled and gauges["kv_cache_usage"] == 0
        if settled or time.monotonic() - start > timeout_s:
            return {**gauges, "settled": settled, "settle_s": round(time.monotonic() - start, 2)}
        time.sleep(0.2)


def memory_mib(pid: int) -> dict[str, float | None]:
    """The process's resident set now and at its peak (VmHWM), from /proc (Linux)."""
    fields: dict[str, float | None] = {"VmRSS": None, "VmHWM": None}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in fields:
                fields[name] = round(int(value.split()[0]) / 1024, 1)  # kB
    except (OSError, ValueError, IndexError):
        pass
    return {"rss_mib": fields["VmRSS"], "peak_rss_mib": fields["VmHWM"]}


def health_status(base_url: str) -> int | None:
    try:
        return httpx.get(f"{base_url}/health", timeout=30).status_code
    except httpx.HTTPError:
        return None


def logged_errors(log: Path) -> list[str]:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if ERROR_LINE.search(line)]


def discover_model(base_url: str) -> str | None:
    try:
        return httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None
