"""Disconnects, concurrency, admission control, auth, body limits and engine death."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from server.async_engine import AsyncEngine
from tests.server.conftest import (
    MODEL_NAME,
    assert_openai_error,
    make_engine,
    random_ids,
    running_server,
    sse_payloads,
    tracebacks,
    wait_until,
)

ABORT = {"finished_reason": "abort"}


def long_request(seed: int, stream: bool) -> dict:
    # ~900 decode steps: far longer than the abort takes to show up.
    return {"model": MODEL_NAME, "prompt": random_ids(seed, 30), "max_tokens": 900,
            "ignore_eos": True, "temperature": 0, "stream": stream}  # fmt: skip


def wait_aborted_and_clean(server, aborts_before: float, count: int = 1) -> None:
    wait_until(
        lambda: server.metric("pagedserve:request_success_total", **ABORT) == aborts_before + count,
        30,
        "the request was not aborted",
    )
    wait_until(server.all_blocks_free, 30, "blocks were not freed")
    wait_until(lambda: server.metric("pagedserve:num_requests_running") == 0, 30, "still running")
    assert server.metric("pagedserve:kv_cache_usage_perc") == 0


def test_client_disconnect_mid_stream_aborts_the_request(server):
    aborts = server.metric("pagedserve:request_success_total", **ABORT)
    with (
        server.http() as http,
        http.stream("POST", "/v1/completions", json=long_request(401, True)) as r,
    ):
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leaving the block closes the connection mid-stream
    wait_aborted_and_clean(server, aborts)


def test_client_disconnect_during_non_streaming_request_aborts_it(server):
    aborts = server.metric("pagedserve:request_success_total", **ABORT)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=long_request(402, False), timeout=1.0)
    wait_aborted_and_clean(server, aborts)


def test_chat_stream_disconnect_aborts_all_n_choices(server):
    aborts = server.metric("pagedserve:request_success_total", **ABORT)
    body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 900, "n": 2,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:
                break
    wait_aborted_and_clean(server, aborts, count=2)


def batched_steps(server) -> float:
    """Engine steps that ran more than one request."""
    samples = server.metrics()
    total = samples[("pagedserve:iteration_requests_count", ())]
    single = samples[("pagedserve:iteration_requests_bucket", (("le", "1.0"),))]
    return total - single


def test_32_concurrent_streaming_clients_all_finish_in_shared_batches(server):
    batched_before = batched_steps(server)

    async def one(client, i):
        text, finish = "", None
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=random_ids(500 + i, 12), max_tokens=8, stream=True,
            temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="x", timeout=120, max_retries=0
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    assert all(finish == "length" and text for text, finish in results)
    assert batched_steps(server) > batched_before
    wait_until(server.all_blocks_free, 30, "blocks were not freed")


# ------------------------------------------------------------- a server with every limit on

API_KEY = "test-key"
BODY_LIMIT = 20_000


@pytest.fixture(scope="module")
def strict_server(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=128, max_num_seqs=1)
    with running_server(
        engine, api_key=API_KEY, max_waiting_requests=1, max_request_body_bytes=BODY_LIMIT
    ) as s:
        yield s


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_api_key_is_required_except_for_health_and_metrics(strict_server):
    http = strict_server.http()
    body = {"prompt": "hi", "max_tokens": 1}
    error = assert_openai_error(http.post("/v1/completions", json=body), 401)
    assert error["code"] == "invalid_api_key"
    wrong = {"Authorization": "Bearer nope"}
    assert_openai_error(http.post("/v1/completions", json=body, headers=wrong), 401)
    assert_openai_error(http.get("/v1/models"), 401)
    assert_openai_error(http.post("/tokenize", json={"prompt": "x"}), 401)
    assert http.post("/v1/completions", json=body, headers=AUTH).status_code == 200
    assert http.get("/health").status_code == 200
    assert http.get("/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        strict_server.openai(api_key="nope").models.list()
    assert strict_server.openai(api_key=API_KEY).models.list().data[0].id == MODEL_NAME


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": f"bearer {API_KEY}"},  # the scheme in any case (RFC 9110 11.1)
        {"Authorization": f"BEARER {API_KEY}"},
        {"Authorization": f"Bearer   {API_KEY}"},
        {"x-api-key": API_KEY},  # Anthropic's SDK
        {"X-Api-Key": API_KEY, "Authorization": "Bearer nope"},  # either header may hold it
    ],
)
def test_api_key_header_forms_are_accepted(strict_server, headers):
    response = strict_server.http().get("/v1/models", headers=headers)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": "bearer nope"},
        {"Authorization": f"Basic {API_KEY}"},  # another scheme
        {"Authorization": API_KEY},  # no scheme
        {"Authorization": f"Bearer{API_KEY}"},
        {"x-api-key": "nope"},
        {"x-api-key": f"Bearer {API_KEY}"},
        {"x-api-key": ""},
    ],
)
def test_a_wrong_key_in_any_form_is_401(strict_server, headers):
    response = strict_server.http().get("/v1/models", headers=headers)
    error = assert_openai_error(response, 401)
    assert error["code"] == "invalid_api_key" and "x-api-key" in error["message"]


def test_a_401_and_a_413_log_one_line(strict_server, server_log):
    http = strict_server.http()
    assert http.get("/v1/models").status_code == 401
    too_big = {"prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 1}
    assert http.post("/v1/completions", json=too_big, headers=AUTH).status_code == 413
    lines = [r.getMessage() for r in server_log if r.name == "server.errors"]
    assert len(lines) == 2 and "401" in lines[0] and "413" in lines[1], lines
    assert not tracebacks(server_log)


def test_body_over_the_limit_is_413(strict_server):
    http = strict_server.http(headers=AUTH)
    big = {"prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 1}
    error = assert_openai_error(http.post("/v1/completions", json=big), 413)
    assert str(BODY_LIMIT) in error["message"]

    def chunks(total):  # no Content-Length: the server must count what arrives
        payload = json.dumps({"prompt": "y" * total, "max_tokens": 1}).encode()
        for i in range(0, len(payload), 4096):
            yield payload[i : i + 4096]

    assert_openai_error(http.post("/v1/completions", content=chunks(BODY_LIMIT + 10)), 413)
    small = http.post(
        "/v1/completions", content=chunks(100), headers={"content-type": "application/json"}
    )
    assert small.status_code == 200, small.text


def test_full_waiting_queue_is_503_with_retry_after(strict_server):
    http_a, http_b = strict_server.http(headers=AUTH), strict_server.http(headers=AUTH)
    aborts = strict_server.metric("pagedserve:request_success_total", **ABORT)
    with http_a.stream("POST", "/v1/completions", json=long_request(601, True)) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # keep a reference: a collected iterator closes the stream
        assert next(line for line in lines if line.startswith("data: "))
        # max_num_seqs=1: with the first request running, the second one waits.
        with http_b.stream("POST", "/v1/completions", json=long_request(602, True)) as waiting:
            assert waiting.status_code == 200
            wait_until(lambda: strict_server.client.num_waiting == 1, 30, "nothing waiting")
            response = strict_server.http(headers=AUTH).post(
                "/v1/completions", json={"prompt": "hi", "max_tokens": 1}
            )
            error = assert_openai_error(response, 503)
            assert response.headers["retry-after"] == "1"
            assert error["code"] == "server_overloaded"
    wait_aborted_and_clean(strict_server, aborts, count=2)
    body = {"prompt": "hi", "max_tokens": 1}
    assert strict_server.http(headers=AUTH).post("/v1/completions", json=body).status_code == 200


# ----------------------------------------------------------------------- failed steps, death

POISON = random_ids(990, 12)  # a prompt the injected fault recognises


def poison_runner(engine, monkeypatch) -> None:
    """A fault injected into the model runner for every step that runs a poisoned request."""
    real_execute = engine.core.runner.execute

    def execute(sched_out):
        if any(s.request.prompt_token_ids[: len(POISON)] == POISON for s in sched_out.scheduled):
            raise RuntimeError("injected fault")
        return real_execute(sched_out)

    monkeypatch.setattr(engine.core.runner, "execute", execute)


def test_a_failed_step_fails_its_requests_and_the_server_goes_on(
    tiny_model_dir, monkeypatch, caplog
):
    # max_num_seqs=1: a step runs one request, so of n=3 choices one fails in its step
    # while its two siblings wait; they are aborted with it.
    engine = make_engine(tiny_model_dir, num_blocks=128, max_num_seqs=1)
    poison_runner(engine, monkeypatch)
    error_label = {"finished_reason": "error"}
    with running_server(engine) as server:
        http = server.http()

        def served_normally(seed: int) -> None:  # the engine goes on (and a step succeeds)
            assert http.get("/health").status_code == 200
            ok = http.post("/v1/completions", json={"prompt": random_ids(seed, 8), "max_tokens": 3})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
            wait_until(server.all_blocks_free, 30, "blocks were not freed")

        poisoned = {"model": MODEL_NAME, "prompt": POISON, "max_tokens": 4}
        failed = http.post("/v1/completions", json=poisoned)
        error = assert_openai_error(failed, 500)
        assert error["code"] == "engine_error" and "injected fault" in error["message"]
        served_normally(991)
        with http.stream("POST", "/v1/completions", json={**poisoned, "stream": True}) as stream:
            assert stream.status_code == 200
            events = sse_payloads(stream.iter_lines())
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_error"
        served_normally(992)
        aborts = server.metric("pagedserve:request_success_total", **ABORT)
        failed_n = http.post("/v1/completions", json={**poisoned, "n": 3, "temperature": 1})
        assert assert_openai_error(failed_n, 500)["code"] == "engine_error"
        served_normally(993)
        assert server.metric("pagedserve:request_success_total", **error_label) == 3
        assert server.metric("pagedserve:request_success_total", **ABORT) == aborts + 2
        assert server.client.is_alive
    failures = [r for r in caplog.records if "engine step failed" in r.getMessage()]
    assert len(failures) == 3 and all(r.exc_info for r in failures)  # once each, with traceback


def test_an_engine_that_keeps_failing_is_declared_dead(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir, num_blocks=128)
    real_step, broken = engine.core.step, threading.Event()

    def step():
        if broken.is_set():
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(engine.core, "step", step)
    with running_server(engine) as server, ThreadPoolExecutor(1) as pool:
        http = server.http()
        assert http.get("/health").status_code == 200
        with http.stream("POST", "/v1/completions", json=long_request(701, True)) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            pending = pool.submit(
                httpx.post,
                f"{server.url}/v1/completions",
                json=long_request(702, False),
                timeout=60,
            )
            wait_until(
                lambda: len(engine.core.scheduler.requests) == 2, 30, "second request not added"
            )
            broken.set()  # failed step 1 of 3: both requests in flight fail with it
            rest = sse_payloads(lines)
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["code"] == "engine_error" and "injected step failure" in error["message"]
        assert assert_openai_error(pending.result(timeout=60), 500)["code"] == "engine_error"
        assert http.get("/health").status_code == 200  # one failed step is not death
        body = {"prompt": "hi", "max_tokens": 1}
        for _ in range(2):  # failed steps 2 and 3
            assert_openai_error(http.post("/v1/completions", json=body), 500)
        wait_until(lambda: not server.client.is_alive, 30, "the engine was not declared dead")
        assert server.client.died_of_failure
        assert "3 engine steps failed in a row" in server.client.dead_reason
        assert_openai_error(http.get("/health"), 503)
        later = http.post("/v1/completions", json=body)
        assert assert_openai_error(later, 503)["code"] == "engine_dead"
        assert not engine.has_unfinished_requests()


def test_load_builds_the_engine_on_the_thread_that_steps_it(tiny_model_dir):
    # One thread for all torch work keeps libgomp to one team (server/async_engine.py).
    threads: dict[str, threading.Thread] = {}

    def build():
        threads["built"] = threading.current_thread()
        core = make_engine(tiny_model_dir).core
        step = core.step

        def recording_step():
            threads["stepped"] = threading.current_thread()
            return step()

        core.step = recording_step
        return core

    client = AsyncEngine.load(build, log_interval_s=1.0)
    assert threads["built"] is not threading.current_thread()
    with running_server(client.core, client) as s:
        completion = s.openai().completions.create(
            model=MODEL_NAME, prompt=random_ids(501, 8), max_tokens=4, temperature=0
        )
        assert completion.usage.completion_tokens == 4
        assert threads["stepped"] is threads["built"]
        wait_until(s.all_blocks_free, 30, "blocks were not freed")


def test_load_raises_what_building_the_engine_raised():
    def build():
        raise ValueError("model 'nope' does not exist")

    with pytest.raises(ValueError, match="nope"):
        AsyncEngine.load(build)


def test_free_memory_is_released_when_the_engine_goes_idle(tiny_model_dir, monkeypatch):
    # Issue 29, item 4: without this, RSS grew ~100 MB a round of varied prompt lengths.
    calls = []
    monkeypatch.setattr("server.engine_loop.release_free_memory", lambda: calls.append(1))
    engine = make_engine(tiny_model_dir, num_blocks=128)
    with running_server(engine) as server:
        http = server.http()
        ok = http.post("/v1/completions", json={"prompt": random_ids(7, 8), "max_tokens": 3})
        assert ok.status_code == 200
        wait_until(lambda: calls, 30, "no release after the request finished")
        assert len(calls) == 1  # once per busy period, not per step
        assert not server.client.num_in_flight
