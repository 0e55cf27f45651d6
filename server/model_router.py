"""Several models behind one server: each request goes to the model its `model` field
names, which is loaded first if it is not (that request waits; the others keep being
served), within the budget (server/model_budget.py).

Each loaded model is an engine of its own (an `EngineClient`: its engine thread, KV pool,
prefix cache and metrics) with its own `ServingContext`, so the endpoints serve it exactly
as they serve a single model. The router owns every model's state (server/model_registry.py)
and changes it only on the event loop:

- a load runs the loader on a worker thread (the engine builds on its own thread, see
  server/async_engine.py), so the event loop keeps serving the loaded models;
- loads decide their room one at a time (`_room`): while a load does not fit, the least
  recently used unpinned model is unloaded, idle ones before busy ones;
- an unload is a drain: the model takes no new request (one that names it waits and loads
  it again), the requests it holds run to their end, then its engine stops. Nothing is cut,
  and every request has returned its KV blocks before the pool goes.

A request holds a lease on its model from routing until its work is in the engine (the
engine's own count covers it from then on, streams included), so a drain sees it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

from server.engine_client import EngineClient
from server.errors import SERVER_ERROR, OpenAIError, bad_request, engine_dead, shutting_down
from server.model_budget import ModelBudget, eviction_candidates, measured_kv_bytes
from server.model_metrics import ModelMetrics
from server.model_registry import ModelEntry, ModelRegistry, ModelState

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.02  # how often a draining model's in-flight count is looked at

# Builds a model's engine (blocking), with `entry.tokenizer` when it has one.
Loader = Callable[[ModelEntry], EngineClient]
ContextFactory = Callable[[EngineClient, str], Any]  # its ServingContext (server/app.py)


class ModelRouter:
    def __init__(
        self,
        registry: ModelRegistry,
        loader: Loader,
        budget: ModelBudget | None = None,
        metrics: ModelMetrics | None = None,
    ) -> None:
        self.registry = registry
        self.budget = budget or ModelBudget()
        self.metrics = metrics or ModelMetrics(lambda: list(registry))
        self._loader = loader
        self._room = asyncio.Lock()  # one load at a time decides what it evicts
        self._make_context: ContextFactory | None = None
        self.closing = False

    def bind(self, make_context: ContextFactory) -> None:
        """How a loaded model's ServingContext is made (the app's options, its engine)."""
        self._make_context = make_context

    # -- start and stop -----------------------------------------------------------------

    def load_now(self, entry: ModelEntry) -> None:
        """Load a model before the server starts (the default, the pinned ones); ValueError
        when it does not fit the budget, the loader's error when it cannot load."""
        refusal = self.budget.too_large(entry)
        if refusal is None and not self.budget.fits(entry, self.resident()):
            refusal = (f"model {entry.name} does not fit beside the models loaded at start "
                       f"({', '.join(e.name for e in self.resident())}) within "
                       f"{self.budget.describe()}")  # fmt: skip
        if refusal is not None:
            raise ValueError(refusal)
        start = time.monotonic()
        self._loaded(entry, self._loader(entry), time.monotonic() - start)

    async def start(self) -> None:
        for entry in self.loaded():
            await entry.client.start()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self.closing = True
        for entry in self.loaded():
            entry.client.shutdown(timeout_s)

    # -- what is loaded -----------------------------------------------------------------

    def resident(self) -> list[ModelEntry]:
        """The models that hold (or are about to hold) memory."""
        return [e for e in self.registry if e.is_resident]

    def loaded(self) -> list[ModelEntry]:
        """The models with an engine (loaded, or draining to unload)."""
        return [e for e in self.registry if e.client is not None]

    # -- requests -------------------------------------------------------------------------

    @asynccontextmanager
    async def use(self, name: str | None) -> AsyncIterator[Any]:
        """The ServingContext of the model `name` (None: the default), loaded, held until
        the block ends: an unload waits for it."""
        entry = self.registry.find(name)
        await self._ready(entry, retry_failed=False)
        entry.leases += 1  # no await since `_ready` saw it loaded: no unload came between
        try:
            yield self._context(entry)
        finally:
            entry.leases -= 1
            entry.last_used = time.monotonic()

    async def load(self, name: str) -> ModelEntry:
        """Load a model now (POST /models/load); a failed one is tried again."""
        entry = self.registry.find(name)
        await self._ready(entry, retry_failed=True)
        return entry

    async def unload(self, name: str) -> ModelEntry:
        """Unload a model now (POST /models/unload), after its requests end."""
        entry = self.registry.find(name)
        if entry.pinned:
            raise bad_request(f"Model {name} is pinned (--pin): it is never unloaded.",
                              param="model", code="model_pinned")  # fmt: skip
        while entry.state is ModelState.LOADING:
            await asyncio.wait([entry.transition])
        if entry.state is not ModelState.LOADED and entry.state is not ModelState.UNLOADING:
            raise bad_request(f"Model {name} is not loaded (it is {entry.state.value}).",
                              param="model", code="model_not_loaded")  # fmt: skip
        await self._unload(entry)
        return entry

    def loaded_context(self, name: str | None) -> Any:
        """The ServingContext of a loaded model (None: the default), never loading it (the
        dashboard's); 503 when it is not loaded."""
        entry = self.registry.find(name)
        if entry.state is not ModelState.LOADED:
            raise OpenAIError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"Model {entry.name} is {entry.state.value}: only a loaded model's block pool "
                "can be shown.",
                type=SERVER_ERROR,
                param="model",
                code="model_not_loaded",
            )
        return self._context(entry)

    def _context(self, entry: ModelEntry) -> Any:
        if entry.context is None:
            assert self._make_context is not None, "bind() the router to an app first"
            entry.context = self._make_context(entry.client, entry.name)
        return entry.context

    async def _ready(self, entry: ModelEntry, retry_failed: bool) -> None:
        """Return once `entry` is loaded, loading it (or waiting for its load or unload)."""
        while True:
            if self.closing:
                raise shutting_down()
            if entry.state is ModelState.LOADED:
                if entry.client.is_alive:
                    entry.last_used = time.monotonic()
                    return
                self._fail(entry, engine_dead(entry.client.dead_reason or "stopped"))
            if entry.state is ModelState.FAILED:
                if not retry_failed:
                    raise entry.error  # type: ignore[misc]
                entry.state, entry.error, retry_failed = ModelState.UNLOADED, None, False
            if entry.transition is None:  # unloaded: this request loads it
                self._begin(entry, self._load(entry))
            await asyncio.shield(entry.transition)  # its error is this request's too

    def _begin(self, entry: ModelEntry, work: Any) -> asyncio.Task:
        """Run a load or unload as a task of its own: a waiting request that leaves (a
        client disconnect cancels it) does not cancel the work others wait for."""
        task = asyncio.ensure_future(work)
        entry.transition = task

        def done(t: asyncio.Task) -> None:
            if entry.transition is t:
                entry.transition = None
            if not t.cancelled():
                t.exception()  # its waiters got it; keep asyncio from logging it again

        task.add_done_callback(done)
        return task

    # -- loading --------------------------------------------------------------------------

    async def _load(self, entry: ModelEntry) -> None:
        async with self._room:
            refusal = self.budget.too_large(entry)
            if refusal is not None:
                self._fail(entry, bad_request(refusal, param="model", code="model_too_large"))
                raise entry.error  # type: ignore[misc]
            await self._make_room(entry)
            entry.state = ModelState.LOADING
        logger.info("loading model %s (%s)", entry.name, entry.path)
        start = time.monotonic()
        client = None
        try:
            client = await asyncio.to_thread(self._loader, entry)
            await client.start()
        except Exception as exc:  # noqa: BLE001 - any loader failure fails this model only
            if client is not None:  # built, but it would not start: stop its thread
                client.begin_shutdown()
            self._fail(entry, load_failed(entry.name, exc))
            self.metrics.on_load_failed(entry.name)
            raise entry.error from exc  # type: ignore[misc]
        self._loaded(entry, client, time.monotonic() - start)

    def _loaded(self, entry: ModelEntry, client: EngineClient, seconds: float) -> None:
        entry.client, entry.context, entry.error = client, None, None
        entry.tokenizer = client.tokenizer
        entry.kv_bytes = measured_kv_bytes(client) or entry.kv_bytes
        entry.state, entry.load_seconds = ModelState.LOADED, seconds
        entry.last_used = time.monotonic()
        self.metrics.on_loaded(entry.name, seconds)
        logger.info("loaded model %s in %.2f s", entry.name, seconds)

    async def _make_room(self, entry: ModelEntry) -> None:
        """Unload models until `entry` fits; 503 when what is loaded cannot make room."""
        while not self.budget.fits(entry, self.resident()):
            victims = eviction_candidates(self.resident(), entry)
            if victims:
                await self._unload(victims[0])
                continue
            # Models loading (for other requests) or draining: wait, then look again; a
            # model just loaded is unloaded once the requests it was loaded for end.
            pending = [e.transition for e in self.resident() if e.transition is not None]
            if not pending:  # every model held is pinned
                raise no_room(entry, self.budget, self.resident())
            await asyncio.wait(pending)

    def _fail(self, entry: ModelEntry, error: OpenAIError) -> None:
        if entry.client is not None:
            entry.client.begin_shutdown()
        entry.state, entry.error = ModelState.FAILED, error
        entry.client = entry.context = None
        logger.error("model %s failed: %s", entry.name, error.message)

    # -- unloading ------------------------------------------------------------------------

    async def _unload(self, entry: ModelEntry) -> None:
        """Drain `entry`, then stop its engine; returns when it is unloaded."""
        if entry.state is ModelState.LOADED:
            entry.state = ModelState.UNLOADING
            self._begin(entry, self._drain_and_stop(entry))
        if entry.transition is not None:
            await asyncio.shield(entry.transition)

    async def _drain_and_stop(self, entry: ModelEntry) -> None:
        logger.info("unloading model %s: %d request(s) to finish first", entry.name,
                    entry.num_in_flight)  # fmt: skip
        while entry.num_in_flight and entry.client.is_alive:
            await asyncio.sleep(DRAIN_POLL_S)
        client, entry.client, entry.context = entry.client, None, None
        try:
            await asyncio.to_thread(client.shutdown)
        except Exception:  # its thread is told to stop either way: the model is unloaded
            logger.exception("model %s: its engine did not stop cleanly", entry.name)
        # The last reference: no reference cycle holds an engine (server/engine_loop.py,
        # server/async_engine.py), so its weights and KV pool go now, or once its grammar
        # compiler's warm-up, if still running, ends; a full garbage collection here took
        # ~0.3 s of every swap and freed nothing more.
        del client
        entry.state = ModelState.UNLOADED
        self.metrics.on_unloaded(entry.name)
        logger.info("unloaded model %s", entry.name)


def load_failed(name: str, exc: BaseException) -> OpenAIError:
    """A model whose load failed: the loader's message, on one line."""
    reason = " ".join(str(exc).split()) or type(exc).__name__
    return OpenAIError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        f"Model {name} failed to load: {reason}. POST /models/load tries again.",
        type=SERVER_ERROR,
        param="model",
        code="model_load_failed",
    )


def no_room(entry: ModelEntry, budget: ModelBudget, resident: list[ModelEntry]) -> OpenAIError:
    """No model can ever be unloaded for `entry`: the ones held are pinned."""
    held = ", ".join(f"{e.name} ({e.state.value}{', pinned' if e.pinned else ''})"
                     for e in resident) or "none"  # fmt: skip
    return OpenAIError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        f"Model {entry.name} does not fit within {budget.describe()} and no loaded model "
        f"can be unloaded for it (loaded: {held}); unpin one, or raise the budget.",
        type=SERVER_ERROR,
        param="model",
        code="model_budget_full",
    )
