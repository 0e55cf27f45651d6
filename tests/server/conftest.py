"""A real uvicorn server on 127.0.0.1 (free port, background thread) over a tiny random model."""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from engine import EngineConfig, LLMEngine
from server.app import build_app
from server.async_engine import AsyncEngine
from server.limits import ConnectionLimits, uvicorn_config
from tests.engine.tiny_models import VOCAB_SIZE, make_tiny_model_dir

MODEL_NAME = "tiny-test-model"
TINY_MAX_MODEL_LEN = 1024
ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "device": "cpu",
    "block_size": 16,
    "num_blocks": 512,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 2048,
    "seed": 0,
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("server-tiny-model")
    return make_tiny_model_dir(path, max_position_embeddings=TINY_MAX_MODEL_LEN)


def make_engine(model_dir: Path | None, **overrides: Any) -> LLMEngine:
    fields = {**ENGINE_DEFAULTS, **overrides}
    return LLMEngine(EngineConfig(model=str(model_dir) if model_dir else None, **fields))


@dataclass
class RunningServer:
    url: str
    engine: LLMEngine
    client: AsyncEngine

    def openai(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=f"{self.url}/v1", timeout=60, max_retries=0, **kwargs)

    def http(self, **kwargs: Any) -> httpx.Client:
        kwargs.setdefault("timeout", 60)
        return httpx.Client(base_url=self.url, **kwargs)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics as {(name, sorted labels): value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return samples

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def all_blocks_free(self) -> bool:
        core = self.client.core  # `engine` may be the offline engine or the core itself
        kv = core.kv_cache_manager
        return not core.has_unfinished_requests() and kv.num_free_blocks == kv.num_blocks


class _UvicornThread:
    def __init__(self, app: Any, limits: ConnectionLimits | None = None) -> None:
        # IPPROTO_TCP as uvicorn's own socket has it: asyncio sets TCP_NODELAY only on sockets
        # whose proto says TCP, and without it every response with a body waited ~40 ms
        # (Nagle's algorithm against the client's delayed ACK).
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        # The server's own protocol and limits (server/limits.py), as the CLI runs it.
        config = uvicorn_config(app, limits, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self, timeout_s: float = 60) -> None:
        self._thread.start()
        wait_until(lambda: self.server.started, timeout_s, "uvicorn did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self._sock.close()


@contextmanager
def running_server(
    engine: LLMEngine,
    client: AsyncEngine | None = None,
    limits: ConnectionLimits | None = None,
    **app_kwargs: Any,
) -> Iterator[RunningServer]:
    client = client or AsyncEngine(engine, log_interval_s=1.0)
    app_kwargs.setdefault("served_model_name", MODEL_NAME)
    app = build_app(client, **app_kwargs)
    thread = _UvicornThread(app, limits)
    thread.start()
    try:
        yield RunningServer(f"http://127.0.0.1:{thread.port}", engine, client)
    finally:
        thread.stop()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with running_server(make_engine(tiny_model_dir)) as s:
        yield s


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def server_log() -> Iterator[list[logging.LogRecord]]:
    """Every log record of this process while the test runs, the server's INFO lines and
    uvicorn's own logger (which does not propagate to the root) included."""
    handler = _Records()
    targets = [logging.getLogger(), logging.getLogger("uvicorn")]
    server_logger = logging.getLogger("server")
    old_level = server_logger.level
    server_logger.setLevel(logging.INFO)
    for logger in targets:
        logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        for logger in targets:
            logger.removeHandler(handler)
        server_logger.setLevel(old_level)


def tracebacks(records: list[logging.LogRecord]) -> list[str]:
    """The records that carry a traceback, formatted."""
    formatter = logging.Formatter()
    return [formatter.format(r) for r in records if r.exc_info or "Traceback" in r.getMessage()]


def wait_until(predicate: Callable[[], bool], timeout_s: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s: {what}")
        time.sleep(0.05)


def random_ids(seed: int, n: int) -> list[int]:
    """A prompt of n token ids no other test uses (distinct seeds -> distinct prefixes)."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def sse_payloads(lines) -> list[str]:
    """The `data:` payloads of a server-sent event stream, in order ([DONE] included)."""
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]
