"""Graceful shutdown: SIGTERM (what `docker stop` and Kubernetes send) drains, then exits.

The first SIGTERM or Ctrl-C stops admission (new requests and /health answer 503, so a
load balancer stops sending), lets the requests in flight finish for up to the drain
timeout, then aborts what is left (each gets a clean 503 `server_shutdown` error, a
streamed one as its last event) and shuts uvicorn down: the process exits 0. A second
signal skips the rest of the drain. When the engine dies (steps keep failing) the server
shuts down too and the CLI exits 1, so `--restart=on-failure` and Kubernetes restart it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Any

import uvicorn

from server.engine_client import EngineClient

logger = logging.getLogger(__name__)

# docker stop sends SIGKILL 10 s after SIGTERM: draining 8 s leaves time to fail the rest.
DEFAULT_DRAIN_TIMEOUT_S = 8.0


class GracefulServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, engine: EngineClient, drain_timeout_s: float
    ) -> None:
        super().__init__(config)
        self._engine = engine
        self._drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's: it re-raises the signal after shutting down, so SIGTERM would end
        # the process by that signal (exit 143) instead of exit 0 after a clean drain.
        if self._drain_requested or self._loop is None:
            # A second signal (or one before serving began): stop now; a third Ctrl-C
            # does not even wait for connections to close.
            self.force_exit = self.should_exit and sig == signal.SIGINT
            self.should_exit = True
            return
        self._drain_requested = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        self._engine.begin_drain()
        logger.info(
            "shutting down: draining %d request(s) for up to %.0f s (a second signal skips it)",
            self._engine.num_in_flight, self._drain_timeout_s,
        )  # fmt: skip
        if not await self._engine.wait_idle(self._drain_timeout_s):
            logger.warning("drain timeout: aborting %d request(s)", self._engine.num_in_flight)
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._engine.died_of_failure:
            self.should_exit = True  # nothing can be served: exit so a supervisor restarts us
        return await super().on_tick(counter)

    async def shutdown(self, sockets: Any = None) -> None:
        # Abort what is still in flight first: otherwise uvicorn would wait for every open
        # stream before the app's lifespan shutdown stops the engine.
        self._engine.begin_shutdown()
        await super().shutdown(sockets=sockets)
