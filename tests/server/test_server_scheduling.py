"""Per-request scheduling fields against a live server: `priority` (lower first) and
`queue_timeout` (a request still unscheduled after it is answered 503 queue_timeout), with
the server-wide default from `--queue-timeout`.

The server runs one request at a time (max_num_seqs=1), so a long request holds the
engine while the others queue. Bounded: a handful of requests, each a second or two.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.conftest import (
    MODEL_NAME,
    RunningServer,
    make_engine,
    running_server,
    wait_until,
)

HOLD_TOKENS = 400  # the tiny model's decode steps are fast: this holds the engine ~1 s


@pytest.fixture(scope="module")
def one_at_a_time(tiny_model_dir) -> Iterator[RunningServer]:
    engine = make_engine(tiny_model_dir, max_num_seqs=1)
    with running_server(engine, queue_timeout=30.0) as s:
        yield s


def hold_engine(server: RunningServer) -> threading.Thread:
    """A long request in the background; returns once the engine has started it."""

    def run() -> None:
        with server.http(timeout=60) as http:
            r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hold",
                          "max_tokens": HOLD_TOKENS, "ignore_eos": True})  # fmt: skip
            assert r.status_code == 200, r.text

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: server.client.num_in_flight == 1 and server.client.num_waiting == 0, 10,
               "the holding request never started")  # fmt: skip
    return thread


def test_a_request_still_queued_past_its_queue_timeout_gets_a_503(one_at_a_time):
    server = one_at_a_time
    holder = hold_engine(server)
    try:
        with pytest.raises(openai.APIStatusError) as raised:
            server.openai().completions.create(
                model=MODEL_NAME, prompt="late", max_tokens=4,
                extra_body={"queue_timeout": 0.2},
            )  # fmt: skip
        assert raised.value.status_code == 503
        error = raised.value.body
        assert error["code"] == "queue_timeout" and error["type"] == "overloaded_error"
        assert "queue_timeout" in error["message"] and "0.2 s" in error["message"]
        assert raised.value.response.headers["retry-after"] == "1"
        # Streamed: the 200 went out with the headers, so the error comes in-band.
        with server.http(timeout=30) as http:
            r = http.post("/v1/chat/completions", json={
                "model": MODEL_NAME, "messages": [{"role": "user", "content": "late"}],
                "max_tokens": 4, "stream": True, "queue_timeout": 0.2})  # fmt: skip
        events = [
            json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")
        ]
        assert events[-1]["error"]["code"] == "queue_timeout"
    finally:
        holder.join(60)
    with server.http() as http:
        metrics = http.get("/metrics").text
    assert 'pagedserve:request_success_total{finished_reason="queue_timeout"} 2.0' in metrics
    engine = server.engine
    wait_until(lambda: engine.core.kv_cache_manager.num_free_blocks == engine.core.num_blocks, 10,
               "blocks were not all returned")  # fmt: skip


def test_the_lowest_priority_value_is_served_first(one_at_a_time):
    server = one_at_a_time
    finished: list[str] = []
    lock = threading.Lock()

    def send(name: str, priority: int) -> None:
        with server.http(timeout=60) as http:
            r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": name,
                          "max_tokens": 3, "priority": priority})  # fmt: skip
        assert r.status_code == 200, r.text
        with lock:
            finished.append(name)

    holder = hold_engine(server)
    senders = []
    try:
        for name, priority in (("later", 10), ("urgent", -3), ("normal", 0)):
            senders.append(threading.Thread(target=send, args=(name, priority)))
            senders[-1].start()
            expected = len(senders)
            wait_until(lambda n=expected: server.client.num_waiting == n, 10, "not queued")
    finally:
        holder.join(60)
        for t in senders:
            t.join(60)
    assert finished == ["urgent", "normal", "later"]


def test_the_server_wide_queue_timeout_applies_unless_the_request_sets_its_own(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_seqs=1)
    with running_server(engine, queue_timeout=0.2) as server:
        holder = hold_engine(server)
        try:
            with server.http(timeout=30) as http:
                body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
                default = http.post("/v1/completions", json=body)
                started = time.monotonic()
                own = http.post("/v1/completions", json={**body, "queue_timeout": 60})
        finally:
            holder.join(60)
    assert default.status_code == 503 and default.json()["error"]["code"] == "queue_timeout"
    assert own.status_code == 200 and time.monotonic() - started > 0.2


@pytest.mark.parametrize(
    "field, value",
    [("priority", 2**40), ("priority", 1.5), ("queue_timeout", 0), ("queue_timeout", -1),
     ("queue_timeout", 1e9), ("queue_timeout", "soon")],
)  # fmt: skip
def test_bad_scheduling_fields_get_a_400_naming_them(one_at_a_time, field, value):
    with httpx.Client(base_url=one_at_a_time.url, timeout=30) as http:
        r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x",
                      "max_tokens": 1, field: value})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
