"""Graceful shutdown and exit codes of a real `python -m server` process.

SIGTERM (docker stop, Kubernetes) drains: new requests and /health get 503 while the
requests in flight finish, up to --drain-timeout; what is left then is aborted with a
clean error; the process exits 0. An engine whose steps keep failing exits 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tests.server.conftest import assert_openai_error, random_ids, sse_payloads, wait_until
from tests.server.test_server_cli import ENGINE_FLAGS, REPO, _healthy, free_port

# A wait for the server's next bytes before the test calls it a hang (httpx's default is
# 5 s): beside two busy processes on 2 cores a stream's chunks came more than 5 s apart.
HANG_S = 60


@contextmanager
def serve_process(
    args: list[str], code: str = "", env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen, str]]:
    """`pagedserve serve ARGS` in a child process (after running `code`, a test-only patch;
    `env` added to the environment)."""
    port = free_port()
    script = textwrap.dedent(code) + textwrap.dedent(f"""
        import sys
        from server.cli import main
        sys.exit(main(["serve", "--port", "{port}", "--log-level", "info", *{args!r}]))
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(url) or proc.poll() is not None, 180, "server did not start")
        assert proc.poll() is None, proc.stdout.read()
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def long_body(seed: int, max_tokens: int) -> dict:
    return {"prompt": random_ids(seed, 10), "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip


def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_model_dir):
    args = ["--model", str(tiny_model_dir), "--drain-timeout", "120", *ENGINE_FLAGS]
    with serve_process(args) as (proc, url):
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=long_body(1201, 900), timeout=HANG_S
        ) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            # Draining: load balancers see 503, a new request is refused with 503.
            wait_until(lambda: _status(f"{url}/health") == 503, 30, "health did not turn 503")
            refused = httpx.post(f"{url}/v1/completions", json=long_body(1202, 4), timeout=HANG_S)
            assert assert_openai_error(refused, 503)["code"] == "server_shutdown"
            rest = sse_payloads(lines)
        assert rest[-1] == "[DONE]"
        chunks = [json.loads(p) for p in rest[:-1]]
        assert not any("error" in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # finished in full
        assert proc.wait(timeout=60) == 0
        output = proc.stdout.read()
        assert "draining 1 request(s)" in output and "Traceback" not in output


AT_EXIT = """
    import atexit
    atexit.register(lambda: print("atexit handler ran", flush=True))
"""


def test_drain_timeout_aborts_the_rest_cleanly_and_exits_0(tiny_model_dir):
    args = ["--model", str(tiny_model_dir), "--drain-timeout", "0.5", *ENGINE_FLAGS]
    # The exit skips the interpreter's teardown (server/cli.py), not the atexit handlers.
    with serve_process(args, AT_EXIT) as (proc, url):
        # 1,000 decode steps take seconds: the drain timeout ends the request.
        body = long_body(1203, 1000)
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=HANG_S) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = sse_payloads(lines)
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["error"]["code"] == "server_shutdown"
        assert proc.wait(timeout=60) == 0
        output = proc.stdout.read()
        assert "drain timeout: aborting 1 request(s)" in output
        assert "atexit handler ran" in output


BROKEN_RUNNER = """
    from engine.model_runner import ModelRunner

    def execute(self, sched_out):  # test-only fault: every step fails
        raise RuntimeError("injected device failure")

    ModelRunner.execute = execute
"""


def test_an_engine_that_keeps_failing_exits_1_for_a_supervisor(tiny_model_dir):
    args = ["--model", str(tiny_model_dir), *ENGINE_FLAGS]
    with serve_process(args, BROKEN_RUNNER) as (proc, url):
        body = {"prompt": "hi", "max_tokens": 2}
        for _ in range(3):
            try:
                failed = httpx.post(f"{url}/v1/completions", json=body, timeout=HANG_S)
            except httpx.TransportError:
                break  # already exiting
            assert failed.status_code in (500, 503), failed.text
        assert proc.wait(timeout=60) == 1
        output = proc.stdout.read()
        assert "exiting: 3 engine steps failed in a row" in output
        assert output.count("injected device failure") >= 3


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=HANG_S).status_code
    except httpx.HTTPError:
        return None
