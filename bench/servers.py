"""A benchmarked server as a subprocess on 127.0.0.1: a free port to start it on, its start
with its output into a log, the wait until it answers, and its stop.

Used by `bench compare`, `bench soak` and each benchmark that starts a server of its own.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import time
from pathlib import Path

import httpx

LOG_TAIL_CHARS = 2000


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerFailed(RuntimeError):
    pass


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    """Until /health (or /v1/models, for servers without /health) answers 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerFailed(f"exited with code {proc.returncode}:\n{_tail(log)}")
        for path in ("/health", "/v1/models"):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + path, timeout=5).status_code == 200:
                    return
        time.sleep(0.5)
    raise ServerFailed(f"not ready after {timeout_s:.0f}s:\n{_tail(log)}")


def _tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError:
        return ""


def launch(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `argv` with stdout and stderr into `log` (which starts with the command line),
    its environment the user's plus `env`: not the OpenMP settings importing `engine` put
    into ours (llama-server uses OpenMP too; it ran with pagedserve's passive waiting until
    this was fixed), which a pagedserve child sets for itself."""
    import engine

    log.parent.mkdir(parents=True, exist_ok=True)
    inherited = {k: v for k, v in os.environ.items() if k not in engine.OPENMP_DEFAULTS_SET}
    env = {**inherited, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "w", encoding="utf-8") as log_file:
        log_file.write("$ " + shlex.join(argv) + "\n")
        log_file.flush()
        # The child keeps its own copy of the file descriptor after ours is closed.
        return subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env)


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM, then SIGKILL after `timeout_s`; the exit code (negative: killed by a signal)."""
    proc.terminate()
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
