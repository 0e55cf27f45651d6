"""The live KV-cache page: GET /dashboard (HTML) and GET /dashboard/state (its JSON).

The page (server/static/dashboard.html: inline CSS and JS, no external assets) polls
/dashboard/state about once a second and draws the block pool on a canvas, one cell per
block, with the counts, the prefix-cache hit rate and the prefixes that hold the most blocks.

The pool belongs to the engine thread, so the state is never read from the event loop:
the engine thread takes a snapshot (`KVCacheManager.snapshot`, a few ms for 100,000 blocks)
between two steps, through the bridge's `call`, and the event loop serves the latest one.
Snapshots are at least `SNAPSHOT_INTERVAL_S` apart however many pages poll, so watching
costs the engine at most a few ms every half second.

The API key: /dashboard is open (the page holds no data), /dashboard/state needs the key
like every other route but /health and /metrics. The page takes it from its URL's fragment
(`/dashboard#key=...`: a fragment never reaches the server or its logs) or asks for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from importlib import resources
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, Field

from kv_cache import PoolSnapshot
from server.engine_client import EngineDeadError
from server.errors import SERVER_ERROR, OpenAIError, bad_request, engine_dead
from server.openapi import responses
from server.serving import ServingContext

if TYPE_CHECKING:
    from engine.core import EngineCore

PAGE_PATH = "/dashboard"
STATE_PATH = "/dashboard/state"
SNAPSHOT_INTERVAL_S = 0.5  # the engine thread takes at most 2 snapshots a second
MAX_PREFIXES = 10  # rows of the page's "prefixes holding the most blocks"
PREVIEW_CHARS = 80  # a prefix's text is cut here (the page shows it as text, never HTML)

PAGE_HTML = resources.files("server").joinpath("static/dashboard.html").read_text("utf-8")


class GroupBlocksModel(BaseModel):
    group: int = Field(description="The KV cache group: layers of one attention kind.")
    attention: str = Field(description='"full", or "sliding_window=W" (W tokens).')
    in_use: int = Field(description="Of the in-use blocks, the ones this group holds.")


class BlockCountsModel(BaseModel):
    free: int = Field(description="Blocks holding nothing reusable (never used, or evicted).")
    cached: int = Field(description="Free blocks still holding a reusable prefix.")
    in_use: int = Field(description="Blocks held by at least one request.")


class PrefixCacheModel(BaseModel):
    queries: int = Field(description="Prompt tokens looked up since start (cumulative).")
    hits: int = Field(description="Of those, tokens found in the cache.")
    hit_rate: float = Field(description="hits / queries; 0 before any query.")


class RequestsModel(BaseModel):
    running: int
    waiting: int


class SpeculationModel(BaseModel):
    method: str = Field(description='`--speculative`: "ngram" or "suffix".')
    draft_tokens: int = Field(description="Draft tokens verified since start (cumulative).")
    accepted_tokens: int = Field(description="Of those, the ones kept.")


class PrefixModel(BaseModel):
    first_block: int | None = Field(description="The chain's first block; null once evicted.")
    blocks: int = Field(description="Cached and in-use blocks of the chains it starts.")
    requests: int = Field(description="Requests holding its blocks now.")
    text: str | None = Field(
        description=f"Its first tokens as text, at most {PREVIEW_CHARS} characters; null "
        "when they are not kept (a cache_salt request's, or a first block not yet full)."
    )


class DashboardState(BaseModel):
    tier: str = Field(description='The block pool shown: "pool", the device\'s KV cache.')
    taken_at: float = Field(description="When the engine took the snapshot (Unix seconds).")
    num_blocks: int
    block_size: int = Field(description="Tokens per block.")
    blocks: BlockCountsModel
    groups: list[GroupBlocksModel] = Field(
        description="A hybrid model's in-use blocks by KV cache group (they add up to "
        "blocks.in_use); empty for a model of one group."
    )
    block_states: str = Field(
        description='One character per block, by block id: "f" free, "c" cached, "u" in use.'
    )
    prefix_cache: PrefixCacheModel
    requests: RequestsModel
    prefixes: list[PrefixModel] = Field(description="The prefixes holding the most blocks.")
    plan: str = Field(description="How a step executes here: the engine's execution plan, "
                      "as the start-up line says it.")  # fmt: skip
    speculation: SpeculationModel | None = Field(
        description="Speculative decoding's drafts; null when it is off."
    )


@dataclass(frozen=True)
class _Taken:
    """What the engine thread hands back: the snapshot and the counters of the same moment."""

    snapshot: PoolSnapshot
    block_size: int
    plan: str
    queries: int
    hits: int
    running: int
    waiting: int
    taken_at: float
    speculation: SpeculationModel | None


def _take(core: EngineCore) -> _Taken:
    """On the engine thread, between steps (`EngineClient.call`)."""
    stats = core.refresh_stats()
    method = core.config.engine.speculative
    speculation = SpeculationModel(
        method=method,
        draft_tokens=stats.spec_num_draft_tokens,
        accepted_tokens=stats.spec_num_accepted_tokens,
    )
    return _Taken(
        speculation=None if method == "off" else speculation,
        snapshot=core.pool_snapshot(MAX_PREFIXES),
        block_size=core.block_size,
        plan=core.compute_summary,
        queries=stats.prefix_cache_queries,
        hits=stats.prefix_cache_hits,
        running=stats.num_running,
        waiting=stats.num_waiting,
        taken_at=time.time(),
    )


def _no_local_pool() -> OpenAIError:
    return OpenAIError(
        HTTPStatus.NOT_IMPLEMENTED,
        "The dashboard shows a local engine's KV block pool; this server's engines run "
        "elsewhere (data-parallel replicas): see /metrics.",
        type=SERVER_ERROR,
        code="dashboard_unavailable",
    )


class DashboardSnapshots:
    """The latest snapshot as JSON bytes, refreshed through the engine thread when older
    than `interval_s`; concurrent pollers share one refresh."""

    def __init__(self, ctx: ServingContext, interval_s: float = SNAPSHOT_INTERVAL_S) -> None:
        self._ctx = ctx
        self._interval_s = interval_s
        self._lock = asyncio.Lock()
        self._body: bytes | None = None
        self._taken_mono = 0.0

    async def latest(self) -> bytes:
        async with self._lock:
            if self._body is None or time.monotonic() - self._taken_mono >= self._interval_s:
                try:
                    taken = await self._ctx.engine.call(_take)
                except EngineDeadError as exc:
                    raise engine_dead(str(exc)) from exc
                if not isinstance(taken, _Taken):  # a remote engine answers False
                    raise _no_local_pool()
                self._body = self._render(taken).model_dump_json().encode()
                self._taken_mono = time.monotonic()
            return self._body

    def _render(self, taken: _Taken) -> DashboardState:
        snap = taken.snapshot
        return DashboardState(
            tier="pool",
            taken_at=taken.taken_at,
            num_blocks=snap.counts.total,
            block_size=taken.block_size,
            plan=taken.plan,
            blocks=BlockCountsModel(
                free=snap.counts.free, cached=snap.counts.cached, in_use=snap.counts.in_use
            ),
            groups=[
                GroupBlocksModel(group=g.group, attention=g.attention, in_use=g.in_use)
                for g in snap.counts.groups
            ],
            block_states=snap.block_states,
            prefix_cache=PrefixCacheModel(
                queries=taken.queries,
                hits=taken.hits,
                hit_rate=taken.hits / taken.queries if taken.queries else 0.0,
            ),
            requests=RequestsModel(running=taken.running, waiting=taken.waiting),
            speculation=taken.speculation,
            prefixes=[
                PrefixModel(
                    first_block=group.first_block_id,
                    blocks=group.num_blocks,
                    requests=group.num_requests,
                    text=self._preview(group.token_ids),
                )
                for group in snap.prefixes
            ],
        )

    def _preview(self, token_ids: tuple[int, ...]) -> str | None:
        if not token_ids:
            return None
        text = self._ctx.tokenizer.decode(list(token_ids))
        return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 1] + "…"


def _refuse_query(request: Request, hint: str, allowed: tuple[str, ...] = ()) -> None:
    """Neither route takes query parameters (but `allowed`): say so rather than ignore one."""
    for name in request.query_params:
        if name not in allowed:
            raise bad_request(f"unknown query parameter '{name}': {hint}", param=name)


# A server of several models: the context of the loaded model `?model=` names (None: the
# default), an OpenAI error if it names none or one not loaded (server/model_router.py).
PickModel = Callable[[str | None], ServingContext]


def add_dashboard_routes(
    app: FastAPI, ctx: ServingContext, pick_model: PickModel | None = None
) -> None:
    snapshots = DashboardSnapshots(ctx)
    allowed = ("model",) if pick_model is not None else ()
    takes = "?model=NAME" if allowed else "none"
    per_model: dict[str, DashboardSnapshots] = {}  # by model, while its context lasts

    def snapshots_for(request: Request) -> DashboardSnapshots:
        if pick_model is None:
            return snapshots
        model_ctx = pick_model(request.query_params.get("model"))
        found = per_model.get(model_ctx.served_model_name)
        if found is None or found._ctx is not model_ctx:  # new, or loaded again since
            found = per_model[model_ctx.served_model_name] = DashboardSnapshots(model_ctx)
        return found

    # Left out of /openapi.json: a page for people, like /docs.
    @app.get(PAGE_PATH, response_class=HTMLResponse, include_in_schema=False)
    async def dashboard_page(request: Request) -> Response:
        hint = f"{PAGE_PATH} takes {takes}"
        if "key" in request.query_params:  # a query string lands in access logs
            hint = f"give the API key after '#' instead: {PAGE_PATH}#key=..."
        _refuse_query(request, hint, allowed)
        return HTMLResponse(PAGE_HTML, headers={"Cache-Control": "no-store"})

    @app.get(STATE_PATH, responses=responses(DashboardState, 400, 401, 501, 503))
    async def dashboard_state(request: Request) -> Response:
        """The KV block pool now (at most SNAPSHOT_INTERVAL_S old), for the /dashboard page."""
        _refuse_query(request, f"{STATE_PATH} takes {takes}", allowed)
        body = await snapshots_for(request).latest()
        return Response(
            body, media_type=JSONResponse.media_type, headers={"Cache-Control": "no-store"}
        )
