"""Connection limits against a live server (server/limits.py): slow clients are closed,
normal requests are still answered, and past a limit the answer is a 503.

Bounded: at most 50 sockets on 127.0.0.1, each test a few seconds. The deadlines below are
loop bounds with a wide margin over the configured timeouts, not measurements.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator

import pytest

from server.cli import build_parser
from server.config_flags import config_from_args
from server.limits import (
    ConnectionLimits,
    LimitedHttpProtocol,
    clamp_to_open_files,
    uvicorn_config,
)
from server.server_config import ServerConfig
from tests.server.conftest import RunningServer, make_engine, running_server, wait_until

SLOW_CONNECTIONS = 50
HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 2.0
KEEP_ALIVE_S = 1.0
# How long a wait for the server's reaction may take before the test calls it a hang: far
# past the timeouts above, so that two busy processes on 2 cores cannot fail it (the
# timeouts' own lengths are not what these tests time).
HANG_S = 60


@pytest.fixture(scope="module")
def slow_server(tiny_model_dir) -> Iterator[RunningServer]:
    limits = ConnectionLimits(
        max_connections=200,
        header_timeout_s=HEADER_TIMEOUT_S,
        body_timeout_s=BODY_TIMEOUT_S,
        keep_alive_timeout_s=KEEP_ALIVE_S,
    )
    with running_server(make_engine(tiny_model_dir), limits=limits) as s:
        yield s


@pytest.fixture(scope="module")
def small_server(tiny_model_dir) -> Iterator[RunningServer]:
    # Long timeouts: here sockets must stay open while the limits are probed.
    limits = ConnectionLimits(
        max_connections=8, max_concurrent_requests=2, header_timeout_s=60, body_timeout_s=60
    )
    with running_server(make_engine(tiny_model_dir, num_blocks=64), limits=limits) as s:
        yield s


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setblocking(False)
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    """True once the server closed its end (EOF or reset); any answer bytes are read away."""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True


def _trickle(sock: socket.socket, byte: bytes = b"a") -> None:
    # A closed socket is what _closed_by_server looks for.
    with contextlib.suppress(BlockingIOError, ConnectionResetError, BrokenPipeError):
        sock.send(byte)


def _get_health(sock: socket.socket) -> None:
    sock.setblocking(True)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    sock.setblocking(False)


def test_slow_clients_are_closed_and_normal_requests_answered(slow_server: RunningServer):
    # One full request as soon as each is connected (its header timeout runs from the
    # connect: asked after the others, the last ones were closed first beside busy
    # processes), then a slow second one on the same socket.
    kept_alive = []
    for _ in range(10):
        kept_alive.append(sock := _connect(slow_server.url))
        _get_health(sock)
    idle = [_connect(slow_server.url) for _ in range(10)]
    slow = [_connect(slow_server.url) for _ in range(SLOW_CONNECTIONS - 20)]
    socks = kept_alive + idle + slow
    for sock in kept_alive + slow:
        _trickle(sock, b"GET /health HTTP/1.1\r\nHost: t\r\nX-Slow: ")
    open_ = set(socks)
    answered = 0
    deadline = time.monotonic() + HANG_S  # a hang guard; the server closes them sooner
    with slow_server.http(timeout=HANG_S) as http:
        while open_ and time.monotonic() < deadline:
            for sock in list(open_):
                if _closed_by_server(sock):
                    open_.discard(sock)
                elif sock not in idle:
                    _trickle(sock)
            # Normal requests go through while the slow ones are held.
            r = http.post(
                "/v1/completions",
                json={"model": "tiny-test-model", "prompt": [5, 6, 7], "max_tokens": 2},
            )
            assert r.status_code == 200, r.text
            answered += 1
            time.sleep(0.2)
    for sock in socks:
        sock.close()
    assert not open_, f"{len(open_)} of {SLOW_CONNECTIONS} slow connections were never closed"
    assert answered >= 1
    assert slow_server.all_blocks_free()


def test_a_slow_body_is_closed_and_its_request_dropped(slow_server: RunningServer):
    sock = _connect(slow_server.url)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: 200\r\n\r\n" + b'{"model": "tiny-test-model", '
    )
    try:
        wait_until(lambda: _closed_by_server(sock), HANG_S, "slow body not closed")
    finally:
        sock.close()
    wait_until(slow_server.all_blocks_free, HANG_S, "blocks held after a dropped body")
    with slow_server.http() as http:
        assert http.get("/health").status_code == 200


def test_an_idle_kept_alive_connection_is_closed(slow_server: RunningServer):
    sock = _connect(slow_server.url)
    try:
        _get_health(sock)
        wait_until(lambda: _closed_by_server(sock), HANG_S, "keep-alive not closed")
    finally:
        sock.close()


def _partial_post(url: str) -> socket.socket:
    """A request whose headers are in and whose body never comes: it holds one request
    slot (uvicorn runs the app as soon as the headers are complete)."""
    sock = _connect(url)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{"
    )
    return sock


def test_requests_past_the_limit_get_an_openai_503(small_server: RunningServer):
    holders = [_partial_post(small_server.url) for _ in range(2)]
    seen: list[dict] = []
    try:
        with small_server.http() as http:

            def refused() -> bool:
                r = http.get("/health")
                if r.status_code == 503:
                    seen.append({"body": r.json(), "retry": r.headers.get("retry-after")})
                return r.status_code == 503

            wait_until(refused, HANG_S, "no 503 with 2 requests in flight and a limit of 2")
    finally:
        for sock in holders:
            sock.close()
    assert seen[0]["body"]["error"]["code"] == "too_many_requests_in_flight"
    assert seen[0]["body"]["error"]["type"] == "overloaded_error"
    assert seen[0]["retry"] == "1"
    with small_server.http() as http:
        wait_until(lambda: http.get("/health").status_code == 200, HANG_S, "not served again")


def test_connections_past_the_limit_get_a_503_and_are_closed(small_server: RunningServer):
    held = [_connect(small_server.url) for _ in range(8)]
    answers: list[bytes] = []
    try:

        def extra_refused() -> bool:
            sock = _connect(small_server.url)
            sock.setblocking(True)
            sock.settimeout(0.5)
            try:
                data = sock.recv(65536)
            except TimeoutError:
                return False  # not counted yet as over the limit: try again
            finally:
                sock.close()
            answers.append(data)
            return True

        wait_until(extra_refused, HANG_S, "a 9th connection was not refused with a limit of 8")
    finally:
        for sock in held:
            sock.close()
    head, _, body = answers[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503")
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "too_many_connections"
    with small_server.http() as http:
        wait_until(lambda: http.get("/health").status_code == 200, HANG_S, "not served again")


def test_the_serve_flags_set_the_limits_and_the_open_file_limit_bounds_them():
    args = build_parser().parse_args(
        ["serve", "--max-connections", "5000", "--max-concurrent-requests", "7",
         "--header-timeout", "3", "--body-timeout", "4.5", "--keep-alive-timeout", "2"]
    )  # fmt: skip
    limits = config_from_args(ServerConfig, args).connection_limits()
    assert limits == ConnectionLimits(5000, 7, 3.0, 4.5, 2.0)
    assert clamp_to_open_files(limits, 1024).max_connections == 1024 - 128
    assert clamp_to_open_files(limits, 100_000) == limits
    defaults = config_from_args(ServerConfig, build_parser().parse_args(["serve"]))
    assert defaults.connection_limits() == ConnectionLimits()
    config = uvicorn_config(object(), limits)
    assert issubclass(config.http, LimitedHttpProtocol) and config.http.limits == limits
    assert config.timeout_keep_alive == 2.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--header-timeout", "0"])
