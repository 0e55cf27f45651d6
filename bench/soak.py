"""`pagedserve bench soak`: many mixed, partly hostile requests against a fresh server; after
the run nothing may be left behind.

The soak starts `python -m server` on 127.0.0.1 at a free port (its output into a log file),
waits for /health, then sends `num_requests` requests with Poisson arrivals at `rate`, meant
to exceed what the server can serve, and `--max-waiting-requests` set on the server so the
overload shows up as 503s instead of an ever-growing queue. The mix (fixed for a seed):

- completions and chat, streaming and not, some with n > 1; every prompt is one of a few
  long shared prefixes (chat: the system message) plus a question of its own;
- `disconnect_fraction` of the well-formed requests leave early on purpose: a stream after
  its first 1-3 events, a non-streaming request after a short random wait;
- `malformed_fraction` are malformed, the kinds of MALFORMED_KINDS in turn.

Each request ends in one outcome: ok, aborted (we left on purpose), 4xx, 503, 5xx (a 5xx
status other than 503, or an error event inside a 200 stream) or transport (connection
errors, timeouts, answers cut short or unparseable). After the last answer the soak waits,
bounded, for /metrics to show no running or waiting request and no KV block in use, reads
the server's peak RSS, stops it with SIGTERM and looks for errors in its log.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.machine import machine_line
from bench.report import load_average
from bench.servers import ServerFailed, free_port, launch, stop, wait_ready
from bench.soak_checks import (
    discover_model,
    health_status,
    logged_errors,
    memory_mib,
    wait_settled,
)
from bench.soak_client import drive
from bench.soak_plan import MALFORMED_KINDS, SoakConfig, plan_requests, shared_prefixes
from bench.soak_report import CLEAN_EXIT_CODE, format_summary, summarize

# The plan, the client, the checks and the report live in bench/soak_*.py; the names the
# tests and callers use are here too.
__all__ = [
    "CLEAN_EXIT_CODE",
    "MALFORMED_KINDS",
    "ServerOptions",
    "SoakConfig",
    "format_summary",
    "plan_requests",
    "run_soak",
    "run_soak_command",
    "shared_prefixes",
    "soak_config_from_args",
]


@dataclass(frozen=True)
class ServerOptions:
    """How to start the server under test: `python -m server` plus these flags."""

    model: str | None = None
    max_waiting_requests: int | None = 16
    max_num_seqs: int | None = 32
    dtype: str | None = None
    extra_args: tuple[str, ...] = ()
    log_level: str = "info"
    log: Path | None = None  # None: a new temporary directory
    startup_timeout_s: float = 900.0
    stop_timeout_s: float = 60.0

    def command(self, port: int) -> list[str]:
        argv = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--log-level", self.log_level]
        for flag, value in (
            ("--model", self.model),
            ("--max-waiting-requests", self.max_waiting_requests),
            ("--max-num-seqs", self.max_num_seqs),
            ("--dtype", self.dtype),
        ):
            if value is not None:
                argv += [flag, str(value)]
        return argv + list(self.extra_args)


# -------------------------------------------------------------------------------- the run


def run_soak(cfg: SoakConfig, server: ServerOptions) -> dict[str, Any]:
    """Start the server, run the soak, stop the server; the summary (see `summarize`).

    Raises ServerFailed when the server does not come up.
    """
    log = server.log or Path(tempfile.mkdtemp(prefix="pagedserve-soak-")) / "server.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = launch(server.command(port), log)
    try:
        wait_ready(url, proc, server.startup_timeout_s, log)
        start_memory = memory_mib(proc.pid)
        model = discover_model(url)
        plan = plan_requests(cfg, model)
        load_before = load_average()
        load = asyncio.run(drive(url, plan, cfg))
        load_after = load_average()
        after = wait_settled(url, cfg.settle_timeout_s)
        after["health"] = health_status(url)
        memory = memory_mib(proc.pid)
    finally:
        stop_start = time.monotonic()
        exit_code = stop(proc, server.stop_timeout_s)
        stop_s = time.monotonic() - stop_start
    proc_info = {
        "rss_start_mib": start_memory["rss_mib"],
        "rss_end_mib": memory["rss_mib"],
        "peak_rss_mib": memory["peak_rss_mib"],
        "exit_code": exit_code,
        "stop_s": round(stop_s, 2),
        "log": str(log),
        "command": shlex.join(server.command(port)),
        # On a shared machine the load says how much of the CPU the server really had.
        "machine": machine_line(),
        "load_avg_1m": [load_before, load_after],
    }
    return summarize(cfg, load, after, proc_info, logged_errors(log))


def soak_config_from_args(args: Any) -> tuple[SoakConfig, ServerOptions]:
    cfg = SoakConfig(
        num_requests=args.num_requests,
        rate=args.rate or None,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        num_prefixes=args.num_prefixes,
        prefix_words=args.prefix_words,
        seed=args.seed,
        disconnect_fraction=args.disconnect_fraction,
        malformed_fraction=args.malformed_fraction,
        multi_choice_fraction=args.multi_choice_fraction,
        malformed_kinds=tuple(args.malformed_kinds),
        timeout_s=args.timeout,
        settle_timeout_s=args.settle_timeout,
    )
    server = ServerOptions(
        model=args.model,
        max_waiting_requests=args.max_waiting_requests,
        max_num_seqs=args.max_num_seqs,
        dtype=args.dtype,
        extra_args=tuple(shlex.split(args.server_args)),
        log_level=args.server_log_level,
        log=args.log,
        startup_timeout_s=args.startup_timeout,
        stop_timeout_s=args.stop_timeout,
    )
    return cfg, server


def run_soak_command(args: Any) -> int:
    """`pagedserve bench soak`: 0 when the soak passed, 1 when it failed, 2 on no server."""
    cfg, server = soak_config_from_args(args)
    try:
        summary = run_soak(cfg, server)
    except ServerFailed as exc:
        print(f"pagedserve bench soak: the server did not start: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        print(f"# wrote {args.out}", file=sys.stderr)
    return 0 if summary["passed"] else 1
