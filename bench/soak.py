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
import random
import re
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.arguments import MALFORMED_KIND_NAMES
from bench.loadgen import arrival_delays
from bench.machine import machine_line
from bench.report import load_average
from bench.server_metrics import parse_metrics
from bench.servers import ServerFailed, free_port, launch, stop, wait_ready
from bench.workloads import SEPARATOR, WORDS

OK, ABORTED, CLIENT_ERROR, OVERLOADED, SERVER_ERROR, TRANSPORT = (
    "ok", "aborted", "4xx", "503", "5xx", "transport",
)  # fmt: skip
OUTCOMES = (OK, ABORTED, CLIENT_ERROR, OVERLOADED, SERVER_ERROR, TRANSPORT)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
JSON_HEADERS = {"Content-Type": "application/json"}

# Every malformed kind answered 200 is a validation hole and fails the soak. The names
# live in bench.arguments, which must build its parser without importing httpx.
MALFORMED_KINDS = MALFORMED_KIND_NAMES
# n at the protocol's maximum times many prompts: far more sequences than any batch holds.
FAN_OUT_N, FAN_OUT_PROMPTS = 128, 1024

# Log lines that mean the server hit something it did not expect (levels are upper case in
# both uvicorn's and pagedserve's formats; an access line's "Internal Server Error" is not).
ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback \(most recent call last\)")
SAMPLES_KEPT = 5
# SIGTERM drains and exits 0 (server/shutdown.py); -SIGKILL means it ignored SIGTERM past
# the timeout, 1 that its engine died.
CLEAN_EXIT_CODE = 0


@dataclass(frozen=True)
class SoakConfig:
    num_requests: int = 2000
    rate: float | None = 20.0  # Poisson arrivals per second; None: all at once
    concurrency: int = 256  # client requests in flight at most
    max_tokens: int = 16  # each well-formed request asks for max_tokens/2..max_tokens
    num_prefixes: int = 4
    prefix_words: int = 200
    seed: int = 0
    disconnect_fraction: float = 0.2
    malformed_fraction: float = 0.05
    multi_choice_fraction: float = 0.1  # requests with n in 2..4
    malformed_kinds: tuple[str, ...] = MALFORMED_KINDS
    timeout_s: float = 300.0  # httpx's per-operation timeout (connect, each read)
    settle_timeout_s: float = 60.0  # how long the server may take to free everything

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.concurrency < 1 or self.max_tokens < 1:
            raise ValueError("num_requests, concurrency and max_tokens must be at least 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        bad = [k for k in self.malformed_kinds if k not in MALFORMED_KINDS]
        if bad:
            raise ValueError(f"unknown malformed kind(s) {', '.join(bad)}")


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


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Planned:
    index: int
    kind: str  # "completion", "chat" or a malformed kind
    path: str
    body: bytes  # raw, so malformed bodies can be sent as they are
    stream: bool = False
    leave_after_events: int | None = None  # a stream we close after this many events
    leave_after_s: float | None = None  # a non-streaming request we give up on
    malformed: bool = False


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def shared_prefixes(cfg: SoakConfig) -> list[str]:
    return [
        f"Context {g}: " + _words(random.Random(f"soak/{cfg.seed}/prefix/{g}"), cfg.prefix_words)
        for g in range(cfg.num_prefixes)
    ]


def plan_requests(cfg: SoakConfig, model: str | None) -> list[Planned]:
    """Every request of the run, in send order; the same for the same config and model."""
    rng = random.Random(f"soak/{cfg.seed}")
    prefixes = shared_prefixes(cfg)
    plan: list[Planned] = []
    num_malformed = 0
    for i in range(cfg.num_requests):
        if cfg.malformed_kinds and rng.random() < cfg.malformed_fraction:
            # In turn rather than at random: a short run still sees every kind.
            kind = cfg.malformed_kinds[num_malformed % len(cfg.malformed_kinds)]
            num_malformed += 1
            plan.append(malformed_request(i, kind, rng, model))
        else:
            plan.append(wellformed_request(i, cfg, rng, prefixes[i % len(prefixes)], model))
    return plan


def wellformed_request(
    index: int, cfg: SoakConfig, rng: random.Random, prefix: str, model: str | None
) -> Planned:
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    n = rng.randint(2, 4) if rng.random() < cfg.multi_choice_fraction else 1
    question = f"Question {index}: {_words(rng, 8)}?"
    body: dict[str, Any] = {
        "max_tokens": rng.randint(max(cfg.max_tokens // 2, 1), cfg.max_tokens),
        "ignore_eos": True,  # every answer runs to max_tokens: a predictable load
        "temperature": 0.0 if n == 1 else 0.8,
    }
    if model is not None:
        body["model"] = model
    if chat:
        body["messages"] = [
            {"role": "system", "content": prefix},
            {"role": "user", "content": question},
        ]
    else:
        body["prompt"] = f"{prefix}{SEPARATOR}{question}\nAnswer:"
    if n > 1:
        body.update(n=n, seed=index)
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    leaves = rng.random() < cfg.disconnect_fraction
    return Planned(
        index,
        "chat" if chat else "completion",
        CHAT if chat else COMPLETIONS,
        json.dumps(body).encode(),
        stream=stream,
        leave_after_events=rng.randint(1, 3) if leaves and stream else None,
        leave_after_s=rng.uniform(0.05, 1.0) if leaves and not stream else None,
    )


def malformed_request(index: int, kind: str, rng: random.Random, model: str | None) -> Planned:
    chat = rng.random() < 0.5
    path = CHAT if chat else COMPLETIONS
    base: dict[str, Any] = {"max_tokens": 4}
    if model is not None:
        base["model"] = model

    def text(value: Any) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": value}]} if chat else {"prompt": value}

    if kind == "invalid-json":
        raw = json.dumps({**base, **text("cut off")})[:-7].encode()  # the closing part missing
        return Planned(index, kind, path, raw, malformed=True)
    if kind == "wrong-type":
        body = {**base, "max_tokens": "many", **({"messages": "hello"} if chat else {"prompt": 7})}
    elif kind == "negative-max-tokens":
        body = {**base, **text("hello"), "max_tokens": -rng.randint(1, 100)}
    elif kind == "unknown-model":
        body = {**base, **text("hello"), "model": f"no-such-model-{index}"}
    elif kind == "lone-surrogate":
        # json.dumps escapes it as \ud800: valid JSON text, but no valid UTF-8 string.
        body = {**base, **text(f"half a character: \ud800 (request {index})")}
    elif kind == "huge-fan-out":
        path = COMPLETIONS  # only completions take a list of prompts
        prompts = [[100 + p % 1000, 200] for p in range(FAN_OUT_PROMPTS)]
        body = {**base, "prompt": prompts, "n": FAN_OUT_N, "max_tokens": 1}
    else:
        raise ValueError(f"unknown malformed kind {kind!r}")
    return Planned(index, kind, path, json.dumps(body).encode(), malformed=True)


# ------------------------------------------------------------------------ one request


@dataclass
class Result:
    index: int
    kind: str
    outcome: str
    status: int | None = None  # the HTTP status (200 for a stream that failed inside)
    detail: str | None = None
    malformed: bool = False


def outcome_of_status(status: int) -> str:
    if status == 200:
        return OK
    if status == 503:
        return OVERLOADED
    if 400 <= status < 500:
        return CLIENT_ERROR
    return SERVER_ERROR if status >= 500 else TRANSPORT  # 1xx/3xx: not an answer


def _brief(text: str) -> str:
    try:
        error = json.loads(text).get("error") or {}
        return str(error.get("message") or error)[:200]
    except (ValueError, AttributeError):
        return text[:200]


async def _read_events(response: httpx.Response, req: Planned) -> Result:
    events = 0
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return Result(req.index, req.kind, OK, 200, malformed=req.malformed)
        payload = json.loads(data)
        if "error" in payload:
            detail = f"error event: {_brief(data)}"
            return Result(req.index, req.kind, SERVER_ERROR, 200, detail, req.malformed)
        events += 1
        if req.leave_after_events is not None and events >= req.leave_after_events:
            # Leaving the `async with` unread closes the connection mid-stream.
            return Result(req.index, req.kind, ABORTED, 200, malformed=req.malformed)
    return Result(req.index, req.kind, TRANSPORT, 200, "stream ended without [DONE]")


async def _exchange(client: httpx.AsyncClient, req: Planned) -> Result:
    async with client.stream("POST", req.path, content=req.body, headers=JSON_HEADERS) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            outcome = outcome_of_status(resp.status_code)
            return Result(
                req.index, req.kind, outcome, resp.status_code, _brief(text), req.malformed
            )
        if req.stream:
            return await _read_events(resp, req)
        payload = json.loads(await resp.aread())
        if not payload.get("choices"):
            return Result(req.index, req.kind, TRANSPORT, 200, "200 without choices")
        return Result(req.index, req.kind, OK, 200, malformed=req.malformed)


async def send(client: httpx.AsyncClient, req: Planned) -> Result:
    """One request to its end; every failure becomes a Result, none is raised."""
    try:
        if req.leave_after_s is None:
            return await _exchange(client, req)
        try:
            return await asyncio.wait_for(_exchange(client, req), req.leave_after_s)
        except asyncio.TimeoutError:  # cancelled mid-request: the connection is closed
            return Result(req.index, req.kind, ABORTED, None, malformed=req.malformed)
    except (httpx.HTTPError, ValueError, OSError) as exc:
        detail = f"{type(exc).__name__}: {exc}"[:200]
        return Result(req.index, req.kind, TRANSPORT, None, detail, req.malformed)


# ------------------------------------------------------------------------------ the load


@dataclass
class LoadOutcome:
    results: list[Result]
    duration_s: float  # first send to last answer
    held_by_cap: int  # arrivals that waited for a free client slot (open loop broken)


async def drive(base_url: str, plan: Sequence[Planned], cfg: SoakConfig) -> LoadOutcome:
    """Send the plan at its arrival times, at most `concurrency` in flight."""
    limit = asyncio.Semaphore(cfg.concurrency)
    progress = _Progress(len(plan))
    held = 0
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    pool = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=pool) as client:

        async def one(req: Planned) -> Result:
            try:
                return await send(client, req)
            finally:
                limit.release()
                progress.tick()

        tasks = []
        start = time.perf_counter()
        due = 0.0
        for req, gap in zip(plan, arrival_delays(len(plan), cfg.rate, cfg.seed), strict=True):
            due += gap  # absolute times: sleeps that overshoot do not lower the rate
            await asyncio.sleep(max(start + due - time.perf_counter(), 0.0))
            held += limit.locked()
            await limit.acquire()
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    return LoadOutcome(results, duration, held)


class _Progress:
    """A line on stderr every tenth of the run: a long soak shows it is alive."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.step = max(total // 10, 1)
        self.start = time.perf_counter()

    def tick(self) -> None:
        self.done += 1
        if self.done % self.step == 0 or self.done == self.total:
            elapsed = time.perf_counter() - self.start
            print(f"# soak: {self.done}/{self.total} done, {elapsed:.0f} s", file=sys.stderr)


# ----------------------------------------------------------------------------- afterwards


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
