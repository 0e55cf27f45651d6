"""Headless chromium driven over the DevTools protocol, for tests of the pages the server
serves (loopback only).

`make` installs Debian's chromium where it is missing (see the Makefile); `CHROMIUM` names
another binary. The protocol goes over the page target's websocket (the `websockets`
package's synchronous client): navigate, evaluate JavaScript, take a screenshot.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    named = os.environ.get("CHROMIUM")
    if named:
        return shutil.which(named) or named
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


# How long Chromium may take to answer before a test calls it a hang: long enough for two
# busy processes on 2 cores beside it (15 s was not, 2026-11-27); nothing here is timed.
HANG_S = 60


class Page:
    """One tab: `evaluate` JavaScript, `wait_for` a condition, `screenshot`."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._ids = itertools.count(1)

    def send(self, method: str, timeout_s: float = HANG_S, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        self._ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:  # events arrive in between: skip them
            message = json.loads(self._ws.recv(timeout=max(deadline - time.monotonic(), 0.01)))
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def navigate(self, url: str, timeout_s: float = HANG_S) -> None:
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", timeout_s, f"{url} did not load")

    def evaluate(self, expression: str) -> Any:
        """The expression's value (JSON-able; a promise is awaited); raises on a JS error."""
        result = self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"JavaScript failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = HANG_S, what: str = "") -> Any:
        """Poll until the expression is truthy; returns its value."""
        deadline = time.monotonic() + timeout_s
        while not (value := self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s}s: {what or expression}")
            time.sleep(0.05)
        return value

    def screenshot(self, path: Path) -> None:
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(data["data"]))


@contextlib.contextmanager
def headless_page(
    chromium: str, window: tuple[int, int] = (1280, 900), timeout_s: float = 30
) -> Iterator[Page]:
    """A headless chromium with one blank tab; the browser is gone when the block ends."""
    # Chromium's helper processes (renderer, zygote, crash handler) outlive its main one for
    # a moment: they run in their own session, killed as a group below, and a straggler's
    # last write must not fail the removal of the profile.
    with tempfile.TemporaryDirectory(prefix="chromium-", ignore_cleanup_errors=True) as profile:
        log = open(Path(profile) / "stderr.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            [
                chromium, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
                "--no-default-browser-check", "--no-proxy-server", "--disable-extensions",
                "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                f"--user-data-dir={profile}", f"--window-size={window[0]},{window[1]}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )  # fmt: skip
        try:
            try:
                port = _devtools_port(Path(profile), proc, timeout_s)
                targets = _retry(lambda: httpx.get(f"http://127.0.0.1:{port}/json/list").json())
                page = next(t for t in targets if t["type"] == "page")
            except Exception:
                log.flush()
                tail = (Path(profile) / "stderr.log").read_text(errors="replace")[-3000:]
                print(f"chromium's stderr (tail):\n{tail}")
                raise
            with connect(page["webSocketDebuggerUrl"], max_size=None, proxy=None) as ws:
                yield Page(ws)
        finally:
            _kill_group(proc, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                _kill_group(proc, signal.SIGKILL)
                proc.wait(10)
            log.close()


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _devtools_port(profile: Path, proc: subprocess.Popen, timeout_s: float) -> int:
    """Chromium writes the port it picked to DevToolsActivePort in its profile."""
    active = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with status {proc.returncode} at start")
        with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
            return int(active.read_text().splitlines()[0])
        time.sleep(0.05)
    raise RuntimeError(f"chromium did not open its DevTools port within {timeout_s}s")


def _retry(fn: Callable[[], Any], attempts: int = 50) -> Any:
    for attempt in range(attempts):
        try:
            return fn()
        except httpx.HTTPError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.1)
