"""An asyncio load generator for OpenAI-compatible `/v1/completions` and chat endpoints.

httpx sends the requests and this module parses the server-sent events itself (no SDK), so
each token's arrival is timed with almost no client overhead. Failures of any kind become
`RequestResult(ok=False, error=...)`: a benchmark counts errors, it never stops on one.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.workloads import Conversation, Prompt

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class LoadConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model /v1/models lists
    # The model-* workloads' models, by index (bench/workloads.py); (): every model
    # /v1/models lists, in its order.
    models: tuple[str, ...] = ()
    endpoint: str = "completions"  # or "chat"
    max_tokens: int = 64
    concurrency: int | None = None  # requests (multi-turn: conversations) in flight at most
    request_rate: float | None = None  # Poisson arrivals per second; None: all at once
    stream: bool = True
    ignore_eos: bool = True
    temperature: float = 0.0
    api_key: str | None = None
    seed: int = 0  # the arrival times' seed
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")


@dataclass
class RequestResult:
    ok: bool
    latency: float = 0.0  # seconds from send to the last byte
    ttft: float | None = None  # seconds to the first non-empty text (streaming only)
    itl: list[float] = field(default_factory=list)  # gaps between text chunks
    output_tokens: int = 0  # usage.completion_tokens, else the number of text chunks
    prompt_tokens: int | None = None  # usage.prompt_tokens when the server reports it
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    text: str = ""
    error: str | None = None
    prompt: str | list[dict[str, Any]] | None = None  # what was sent (prompt or messages)
    model: str | None = None  # the model it was sent to


@dataclass
class LoadRun:
    results: list[RequestResult]
    duration: float  # first send to last answer
    model: str | None


# ------------------------------------------------------------------------------ one request


def request_body(cfg: LoadConfig, model: str | None, prompt: str | list[dict]) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature}
    if model is not None:
        body["model"] = model
    body["messages" if cfg.endpoint == "chat" else "prompt"] = prompt
    if cfg.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    return body


def _chunk_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    if "message" in choice:
        return (choice.get("message") or {}).get("content") or ""
    return choice.get("text") or ""


def _apply_usage(result: RequestResult, usage: dict[str, Any] | None) -> None:
    if not usage:
        return
    if usage.get("completion_tokens") is not None:
        result.output_tokens = int(usage["completion_tokens"])
    if usage.get("prompt_tokens") is not None:
        result.prompt_tokens = int(usage["prompt_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        result.cached_tokens = int(details["cached_tokens"])


def _error_message(payload: Any) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error if error is not None else payload)


async def _read_stream(response: httpx.Response, start: float, result: RequestResult) -> None:
    last = start
    chunks = 0
    parts: list[str] = []
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        payload = json.loads(data)
        if "error" in payload:
            raise RuntimeError(f"error event: {_error_message(payload)}")
        text = "".join(_chunk_text(c) for c in payload.get("choices") or [])
        if text:
            now = time.perf_counter()
            if result.ttft is None:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
            chunks += 1
            parts.append(text)
        _apply_usage(result, payload.get("usage"))
    result.text = "".join(parts)
    if result.output_tokens == 0:  # no usage: a chunk is one token on the servers measured
        result.output_tokens = chunks


async def send_request(
    client: httpx.AsyncClient, cfg: LoadConfig, body: dict[str, Any]
) -> RequestResult:
    """POST one request and time it; every failure is returned as a result, not raised."""
    result = RequestResult(ok=False, prompt=body.get("messages", body.get("prompt")))
    start = time.perf_counter()
    try:
        async with client.stream("POST", ENDPOINTS[cfg.endpoint], json=body) as response:
            if response.status_code != 200:
                raw = (await response.aread()).decode(errors="replace")
                try:
                    message = _error_message(json.loads(raw))
                except ValueError:
                    message = raw[:300]
                result.error = f"HTTP {response.status_code}: {message}"
            elif cfg.stream:
                await _read_stream(response, start, result)
                result.ok = True
            else:
                payload = json.loads(await response.aread())
                result.text = "".join(_chunk_text(c) for c in payload.get("choices") or [])
                _apply_usage(result, payload.get("usage"))
                result.ok = True
    except Exception as exc:  # noqa: BLE001 - a load test reports failures, it never stops
        result.ok = False
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency = time.perf_counter() - start
    return result


# ----------------------------------------------------------------------------- the runner


def arrival_delays(n: int, rate: float | None, seed: int) -> list[float]:
    """Gaps before each of n sends: 0 without a rate, else exponential (a Poisson process)."""
    if rate is None:
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(n)]


async def discover_model(client: httpx.AsyncClient) -> str | None:
    """The first model /v1/models lists, or None (the request then names no model)."""
    models = await discover_models(client)
    return models[0] if models else None


async def discover_models(client: httpx.AsyncClient) -> list[str]:
    """Every model /v1/models lists, in its order ([] when it lists none or fails)."""
    try:
        response = await client.get("/v1/models")
        if response.status_code != 200:
            return []
        return [str(card["id"]) for card in response.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return []


def model_of(prompt: Prompt, model: str | None, models: Sequence[str]) -> str | None:
    """The model a prompt goes to: its index into `models` (the model-* workloads), else
    the run's one model."""
    if prompt.model_index is None or not models:
        return model
    return models[prompt.model_index % len(models)]


def make_client(cfg: LoadConfig, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return httpx.AsyncClient(
        base_url=cfg.base_url,
        headers=headers,
        timeout=httpx.Timeout(cfg.timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


class _Progress:
    """A tqdm bar on stderr, or nothing."""

    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="req", leave=False)

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def _schedule(
    units: Sequence[Any],
    cfg: LoadConfig,
    run_unit: Callable[[Any], Awaitable[list[RequestResult]]],
) -> list[RequestResult]:
    """Start each unit after its arrival gap, at most `concurrency` at a time; in order."""
    limit = asyncio.Semaphore(cfg.concurrency or max(len(units), 1))

    async def guarded(unit: Any) -> list[RequestResult]:
        async with limit:
            return await run_unit(unit)

    tasks = []
    for unit, delay in zip(
        units, arrival_delays(len(units), cfg.request_rate, cfg.seed), strict=True
    ):
        if delay:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(guarded(unit)))
    return [r for unit_results in await asyncio.gather(*tasks) for r in unit_results]


async def run_load(
    cfg: LoadConfig, work: Sequence[Prompt] | Sequence[Conversation], desc: str = "bench"
) -> LoadRun:
    """Send every prompt (or every conversation, turn after turn) and time each request."""
    is_chat = cfg.endpoint == "chat"
    num_requests = sum(len(w.questions) if isinstance(w, Conversation) else 1 for w in work)
    connections = min(cfg.concurrency or max(len(work), 1), max(len(work), 1)) + 2
    progress = _Progress(num_requests, cfg.progress, desc)
    async with make_client(cfg, connections) as client:
        several = any(isinstance(w, Prompt) and w.model_index is not None for w in work)
        models = list(cfg.models) or (await discover_models(client) if several else [])
        model = cfg.model or (models[0] if models else await discover_model(client))

        async def one_prompt(prompt: Prompt) -> list[RequestResult]:
            to = model_of(prompt, model, models)
            body = request_body(cfg, to, _as_chat(prompt.text) if is_chat else prompt.text)
            result = await send_request(client, cfg, body)
            result.model = to
            progress.update()
            return [result]

        async def conversation(template: Conversation) -> list[RequestResult]:
            conv = Conversation(template.context, list(template.questions))  # answers: fresh
            results = []
            for turn in range(len(conv.questions)):
                prompt = conv.chat_messages(turn) if is_chat else conv.completion_prompt(turn)
                result = await send_request(client, cfg, request_body(cfg, model, prompt))
                progress.update()
                results.append(result)
                # A failed turn still continues the conversation, with an empty answer.
                conv.answers.append(result.text)
            return results

        run_unit = conversation if work and isinstance(work[0], Conversation) else one_prompt
        start = time.perf_counter()
        try:
            results = await _schedule(work, cfg, run_unit)
        finally:
            progress.close()
        duration = time.perf_counter() - start
    return LoadRun(results, duration, ",".join(models) if several else model)


def _as_chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]
