"""A structured request never waits without bound (--grammar-compile-timeout): a compile
that runs past the limit is a 400 naming the constraint's field, one that cannot get the
compile thread within it a 503 with Retry-After; the server goes on serving, and holds no
KV block afterwards.

A real server and the OpenAI SDK; the engine's compile is wrapped so that a schema which
names `GATED` blocks until the test opens the gate (a compile as slow as the test needs).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from server.async_engine import AsyncEngine
from server.cli import build_parser
from server.grammar_compiler import GrammarCompiler
from server.serving import DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S
from tests.server.conftest import (
    MODEL_NAME,
    RunningServer,
    make_engine,
    running_server,
    wait_until,
)

TIMEOUT_S = 2.0
GATED = "gated_field"
ASK = [{"role": "user", "content": "hi"}]


class Gate:
    """Holds every compile of a spec that names GATED until `open`."""

    def __init__(self, compile_spec: Any) -> None:
        self._compile = compile_spec
        self._open = threading.Event()
        self.held = 0

    def __call__(self, spec: Any) -> Any:
        if GATED in spec.spec:
            self.held += 1
            self._open.wait(120)
        return self._compile(spec)

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()


@pytest.fixture(scope="module")
def gated(tiny_model_dir: Path) -> Iterator[tuple[RunningServer, Gate]]:
    engine = make_engine(tiny_model_dir)
    manager = engine.core.structured_outputs
    gate = Gate(manager.compile)
    manager.compile = gate  # what AsyncEngine.compile_grammar runs on the compile thread
    # One abandoned compile thread at most, so that the second gated compile keeps the
    # compile thread (the 503 case).
    compiler = GrammarCompiler(max_abandoned=1)
    client = AsyncEngine(engine, log_interval_s=1.0, grammar_compiler=compiler)
    try:
        with running_server(engine, client, grammar_compile_timeout=TIMEOUT_S) as server:
            yield server, gate
    finally:
        gate.open()


def schema(name: str) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {
            "name": "answer",
            "schema": {"type": "object", "properties": {name: {"type": "integer"}},
                       "required": [name], "additionalProperties": False},
        },
    }  # fmt: skip


def chat(server: RunningServer, **kwargs: Any) -> Any:
    return server.openai().chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=4, temperature=0, **kwargs
    )


def grammar_hits(server: RunningServer) -> float:
    return server.metric("pagedserve:grammar_requests_total", cache="hit")


def wait_clean(server: RunningServer) -> None:
    """Every compile thread done, nothing in flight, every KV block free."""
    compiler = server.client._compiler
    wait_until(lambda: compiler.num_abandoned == 0, 60, "an abandoned compile still runs")
    wait_until(lambda: server.client.num_in_flight == 0, 30, "requests still in flight")
    wait_until(server.all_blocks_free, 30, "KV blocks still held")


def test_a_compile_past_the_limit_is_400_and_others_are_served(gated):
    server, gate = gated
    gate.close()
    try:
        started = time.monotonic()
        with pytest.raises(openai.BadRequestError) as info:
            chat(server, response_format=schema(GATED + "_1"))
        assert time.monotonic() - started < 30  # the limit's answer, not the client's timeout
        error = info.value.body
        assert info.value.status_code == 400
        assert error["param"] == "response_format.json_schema.schema"
        assert error["code"] == "grammar_compile_timeout"
        assert "--grammar-compile-timeout" in error["message"]
        assert gate.held == 1
        # The overrunning compile still holds its thread; the next ones get a fresh one.
        answer = chat(server, response_format=schema("other_1"))
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert chat(server).choices[0].message is not None
    finally:
        gate.open()
    wait_clean(server)
    # The late compile landed in the grammar cache: the same schema again is a hit.
    hits = grammar_hits(server)
    chat(server, response_format=schema(GATED + "_1"))
    assert grammar_hits(server) == hits + 1
    wait_clean(server)


def test_a_compile_that_cannot_get_the_thread_is_503_with_retry_after(gated):
    server, gate = gated
    gate.close()
    try:
        with pytest.raises(openai.BadRequestError):
            chat(server, response_format=schema(GATED + "_2"))  # abandoned (the one allowed)
        with pytest.raises(openai.BadRequestError):
            chat(server, response_format=schema(GATED + "_3"))  # keeps the compile thread
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as info:
            chat(server, response_format=schema("other_2"))
        assert time.monotonic() - started < 30
        assert info.value.status_code == 503
        assert info.value.response.headers["Retry-After"] == "1"
        error = info.value.body
        assert error["code"] == "grammar_compiler_busy"
        assert error["type"] == "overloaded_error"
        # Requests without a constraint are served meanwhile.
        assert chat(server).choices[0].finish_reason in ("stop", "length")
    finally:
        gate.open()
    wait_clean(server)
    # The refused request's compile never ran; once the threads are free it compiles.
    assert chat(server, response_format=schema("other_2")).choices[0].message is not None
    wait_clean(server)


def test_the_limit_is_a_serve_flag(capsys):
    assert build_parser().parse_args(["serve"]).grammar_compile_timeout == (
        DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S
    )
    args = build_parser().parse_args(["serve", "--grammar-compile-timeout", "2.5"])
    assert args.grammar_compile_timeout == 2.5
    for bad in ("0", "-1", "inf", "soon"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--grammar-compile-timeout", bad])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "--grammar-compile-timeout" in capsys.readouterr().out
