"""The soak's client: sends the plan at its arrival times and turns every answer into one
outcome (bench/soak.py's docstring lists them); no failure is raised.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from bench.loadgen import arrival_delays
from bench.soak_plan import Planned, SoakConfig

OK, ABORTED, CLIENT_ERROR, OVERLOADED, SERVER_ERROR, TRANSPORT = (
    "ok", "aborted", "4xx", "503", "5xx", "transport",
)  # fmt: skip
OUTCOMES = (OK, ABORTED, CLIENT_ERROR, OVERLOADED, SERVER_ERROR, TRANSPORT)

JSON_HEADERS = {"Content-Type": "application/json"}


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
