"""Per-request scheduling fields against a live server: `priority` (lower first) and
`queue_timeout` (a request still unscheduled after it is answered 503 queue_timeout), with
the server-wide default from `--queue-timeout`.

The server runs one request at a time (max_num_seqs=1), and the engine is held before its
next step while the others queue (`engine_held`: by an event, not by a long request, so a
busy machine cannot end the hold early). Bounded: a handful of short requests.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

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


@pytest.fixture(scope="module")
def one_at_a_time(tiny_model_dir) -> Iterator[RunningServer]:
    engine = make_engine(tiny_model_dir, max_num_seqs=1)
    with running_server(engine, queue_timeout=30.0) as s:
        yield s


@contextmanager
def engine_held(server: RunningServer) -> Iterator[Callable[[], None]]:
    """A request in flight, and the engine stopped before its next step until the returned
    `release` is called (or the block ends): requests sent meanwhile stay queued however
    slow the machine is (a long request alone holds the engine only as long as it runs)."""
    core = server.client.core
    gate = threading.Event()
    step = core.step
    steps = 0

    def held_step():  # the engine thread's: the holder's first step runs, then it waits
        nonlocal steps
        steps += 1
        if steps > 1:
            gate.wait(300)
        return step()

    core.step = held_step
    holder = threading.Thread(target=_hold, args=(server,))
    holder.start()
    try:
        wait_until(lambda: server.client.num_in_flight == 1 and server.client.num_waiting == 0
                   and steps > 1, 60, "the holding request never started")  # fmt: skip
        yield gate.set
    finally:
        gate.set()
        del core.step
        holder.join(120)


def _hold(server: RunningServer) -> None:
    with server.http(timeout=120) as http:
        r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hold",
                      "max_tokens": 8, "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200, r.text


def in_background(send: Callable[[], httpx.Response]) -> Callable[[], httpx.Response]:
    """Run send() in a thread; the returned call waits for its response."""
    result: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: result.append(send()))
    thread.start()

    def response() -> httpx.Response:
        thread.join(120)
        return result[0]

    return response


def test_a_request_still_queued_past_its_queue_timeout_gets_a_503(one_at_a_time):
    server = one_at_a_time
    openai_client = server.openai()

    def send_plain() -> object:
        try:
            return openai_client.completions.create(
                model=MODEL_NAME, prompt="late", max_tokens=4, extra_body={"queue_timeout": 0.2}
            )
        except openai.APIStatusError as exc:
            return exc

    with engine_held(server) as release, server.http(timeout=120) as http:
        plain = in_background(send_plain)
        # Streamed: the 200 went out with the headers, so the error comes in-band.
        streamed = in_background(lambda: http.post("/v1/chat/completions", json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "late"}],
            "max_tokens": 4, "stream": True, "queue_timeout": 0.2}))  # fmt: skip
        wait_until(lambda: server.client.num_waiting == 2, 60, "not queued")
        time.sleep(0.3)  # both queued past their 0.2 s
        release()
        raised, r = plain(), streamed()
    assert isinstance(raised, openai.APIStatusError) and raised.status_code == 503
    error = raised.body
    assert error["code"] == "queue_timeout" and error["type"] == "overloaded_error"
    assert "queue_timeout" in error["message"] and "0.2 s" in error["message"]
    assert raised.response.headers["retry-after"] == "1"
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "queue_timeout"
    with server.http() as http:
        metrics = http.get("/metrics").text
    assert 'pagedserve:request_success_total{finished_reason="queue_timeout"} 2.0' in metrics
    engine = server.engine
    wait_until(lambda: engine.core.kv_cache_manager.num_free_blocks == engine.core.num_blocks, 60,
               "blocks were not all returned")  # fmt: skip


def test_the_lowest_priority_value_is_served_first(one_at_a_time):
    server = one_at_a_time
    finished: list[str] = []
    lock = threading.Lock()

    def send(name: str, priority: int) -> httpx.Response:
        with server.http(timeout=120) as http:
            r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": name,
                          "max_tokens": 3, "priority": priority})  # fmt: skip
        with lock:
            finished.append(name)
        return r

    with engine_held(server):
        responses = []
        for name, priority in (("later", 10), ("urgent", -3), ("normal", 0)):
            responses.append(in_background(lambda n=name, p=priority: send(n, p)))
            queued = len(responses)
            wait_until(lambda n=queued: server.client.num_waiting == n, 60, "not queued")
    assert all(r().status_code == 200 for r in responses)
    assert finished == ["urgent", "normal", "later"]


def test_the_server_wide_queue_timeout_applies_unless_the_request_sets_its_own(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_seqs=1)
    with running_server(engine, queue_timeout=0.2) as server, server.http(timeout=120) as http:
        body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
        with engine_held(server) as release:
            default = in_background(lambda: http.post("/v1/completions", json=body))
            own = in_background(
                lambda: http.post("/v1/completions", json={**body, "queue_timeout": 60})
            )
            wait_until(lambda: server.client.num_waiting == 2, 60, "not queued")
            time.sleep(0.3)  # both queued past the server's 0.2 s, neither past its own
            release()
            default, own = default(), own()
    assert default.status_code == 503 and default.json()["error"]["code"] == "queue_timeout"
    assert own.status_code == 200


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
