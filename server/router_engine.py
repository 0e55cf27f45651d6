"""The `EngineClient` the app-wide routes see on a server of several models.

Generation, tokenizing and counting go to each model's own engine (server/model_router.py
hands every request its model's ServingContext). What is left is server-wide: /health
(up while the server is, whichever models are loaded), /metrics (every model's, see
server/model_metrics.py), the SIGTERM drain (every loaded model drains), and `call`,
which reaches the default model's core (the dashboard and /reset_prefix_cache choose
their models themselves, server/app.py). The default model's facts (name, context length, vocabulary,
tokenizer) are the ones this client reports, taken when it first loaded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from server.engine_client import SHUTDOWN_REASON, EngineDeadError, EngineRequest, EngineStream
from server.model_metrics import ModelMetrics
from server.model_registry import ModelState
from server.model_router import ModelRouter


class RouterEngine:
    def __init__(self, router: ModelRouter) -> None:
        default = router.registry.default
        if default.client is None:
            raise ValueError(f"the default model {default.name} must be loaded first")
        self.router = router
        self.tokenizer = default.client.tokenizer
        self.metrics: ModelMetrics = router.metrics
        self._facts = (default.name, default.client.max_model_len, default.client.vocab_size)
        self._draining = False
        self._stopped = False

    # -- facts (the default model's)
    @property
    def model_name(self) -> str:
        return self._facts[0]

    @property
    def max_model_len(self) -> int:
        return self._facts[1]

    @property
    def vocab_size(self) -> int:
        return self._facts[2]

    # -- health and load: the server's, over every loaded model
    @property
    def is_alive(self) -> bool:
        return not self._stopped

    @property
    def is_accepting(self) -> bool:
        return not self._stopped and not self._draining

    @property
    def dead_reason(self) -> str | None:
        return SHUTDOWN_REASON if self._stopped else None

    @property
    def died_of_failure(self) -> bool:
        return False  # a model whose engine dies fails alone (its state says why)

    @property
    def num_in_flight(self) -> int:
        return sum(e.num_in_flight for e in self.router.loaded())

    @property
    def num_waiting(self) -> int:
        return sum(e.client.num_waiting for e in self.router.loaded())

    # -- lifecycle
    async def start(self) -> None:
        await self.router.start()

    def begin_drain(self) -> None:
        """SIGTERM: no new request is routed (503), every loaded model finishes its own."""
        self._draining = self.router.closing = True
        for entry in self.router.loaded():
            entry.client.begin_drain()

    async def wait_idle(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    def begin_shutdown(self) -> None:
        self._stopped = self.router.closing = True
        for entry in self.router.loaded():
            entry.client.begin_shutdown()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self._stopped = True
        self.router.shutdown(timeout_s)

    # -- requests: each model's ServingContext has its own engine
    async def submit(self, requests: list[EngineRequest]) -> EngineStream:
        raise RuntimeError("requests go to their model's engine (ModelRouter.use)")

    async def compile_grammar(self, spec: Any, timeout_s: float | None = None) -> None:
        raise RuntimeError("grammars compile on their model's engine (ModelRouter.use)")

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn on the default model's core."""
        default = self.router.registry.default
        if default.state is not ModelState.LOADED:
            raise EngineDeadError(f"the default model {default.name} is {default.state.value}")
        return await default.client.call(fn)
