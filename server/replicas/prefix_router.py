"""Ray Serve request routers for engine replicas: prefix-cache-aware, and Ray's default.

The rule (`PrefixAwareRouter`): hash the prompt's full blocks as the replicas' KV cache
does (chained SHA-256, the cache salt included, so router and replicas agree across
processes); each replica's cached prefix is how many of those hashes, from the first, it
holds. The replica with the longest cached prefix wins, among the replicas whose load
(requests in flight, asked of each replica as Ray Serve's own router does) is within
`max_load_gap` of the least loaded one; ties go to the lighter load. So a hot prefix fills one replica until it is `max_load_gap`
requests busier than another; the next request goes to the other replica, which then
caches that prefix too, and from there the two share it by load.

What a replica holds comes from its own KV events (`kv_events.py`), which arrive with
its routing stats about once a second. Between two polls the router also remembers the
prompts it sent each replica for `PENDING_S` seconds: a burst of requests sharing a new
prefix then follows the first one instead of scattering before any event arrives.

Both routers keep the replicas' latest routing stats where the ingress can read them
(`replica_stats`): its /metrics serves every replica's metrics from there.
"""

from __future__ import annotations

import asyncio
import importlib
import random
import time
from collections import defaultdict
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from kv_cache import hash_request_tokens
from server.replicas.kv_events import RouterView

# How long a prompt sent to a replica counts as cached there before its events confirm it.
PENDING_S = 10.0
# A replica that does not say how busy it is within this long counts by its last stats.
QUEUE_LEN_DEADLINE_S = 0.1
DEFAULT_MAX_LOAD_GAP = 4

# Deployment -> its router in this process: the latest one made (a handle makes one).
_routers: dict[str, RequestRouter] = {}


def _register(router: RequestRouter) -> None:
    # Through the imported module, not this function's globals: Ray may ship a router class
    # by value (cloudpickle), and a by-value function's globals are a copy of the module's.
    registry = importlib.import_module(__name__)._routers
    registry[str(router._deployment_id)] = router


def replica_stats() -> dict[str, dict[str, Any]]:
    """Every live replica's latest routing stats, by replica id, across this process's
    routers of engine replicas (the ingress has one per deployment handle)."""
    stats: dict[str, dict[str, Any]] = {}
    for router in list(_routers.values()):
        for replica_id, replica in router.curr_replicas.items():
            if replica.routing_stats:
                stats[replica_id.unique_id] = replica.routing_stats
    return stats


class DefaultRouter(PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default routing (power of two choices by queue length), unchanged, made
    visible to `replica_stats`: the baseline the benchmark compares against."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        _register(self)


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    def initialize_state(
        self, block_size: int = 16, max_load_gap: int = DEFAULT_MAX_LOAD_GAP, **kwargs: Any
    ) -> None:
        self._block_size = block_size
        self._max_load_gap = max_load_gap
        self._views: dict[str, RouterView] = defaultdict(RouterView)
        # replica id -> {block hash: when this router sent a prompt holding it there}
        self._pending: dict[str, dict[bytes, float]] = defaultdict(dict)
        _register(self)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for table in (self._views, self._pending):
            for gone in set(table) - live:
                del table[gone]

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        hashes = self._prompt_hashes(pending_request)
        now = time.time()
        loads = await asyncio.gather(*(_load(r) for r in candidate_replicas))
        scored = [(self._cached(r, hashes, now), -load, random.random(), r)
                  for r, load in zip(candidate_replicas, loads, strict=True)]  # fmt: skip
        lightest = min(loads)
        eligible = [s for s in scored if -s[1] - lightest <= self._max_load_gap]
        best = max(eligible)[-1]
        self._remember(best, hashes, now)
        others = [s[-1] for s in sorted(scored, reverse=True) if s[-1] is not best]
        return [[best], others] if others else [[best]]

    # -- the rule's inputs ---------------------------------------------------------------

    def _prompt_hashes(self, pending_request: PendingRequest | None) -> list[bytes]:
        """The chained hashes of the prompt's full blocks (the first engine request's: the
        n choices of one HTTP request share their prompt)."""
        if pending_request is None or not pending_request.args:
            return []
        requests = pending_request.args[0]
        if not requests:
            return []
        first = requests[0]
        salt = getattr(first, "cache_salt", None)
        return hash_request_tokens("sha256", list(first.prompt_token_ids), self._block_size,
                                   (salt,) if salt else ())  # fmt: skip

    def _cached(self, replica: RunningReplica, hashes: list[bytes], now: float) -> int:
        replica_id = replica.replica_id.unique_id
        view = self._views[replica_id]
        stats = replica.routing_stats or {}
        if "kv_events" in stats:
            view.apply(stats["kv_events"])
        pending = self._pending[replica_id]
        count = 0
        for block_hash in hashes:
            if block_hash not in view.blocks and now - pending.get(block_hash, 0.0) > PENDING_S:
                break
            count += 1
        return count

    def _remember(self, replica: RunningReplica, hashes: list[bytes], now: float) -> None:
        replica_id = replica.replica_id.unique_id
        pending = self._pending[replica_id]
        for block_hash in hashes:
            pending[block_hash] = now
        if len(pending) > 4 * len(hashes) + 4096:  # drop the expired ones now and then
            for block_hash in [h for h, t in pending.items() if now - t > PENDING_S]:
                del pending[block_hash]


async def _load(replica: RunningReplica) -> int:
    """Requests in flight on the replica now (Ray Serve's own count, asked of it), or at
    its last stats poll when it does not answer in time."""
    try:
        return await asyncio.wait_for(replica.get_queue_len(deadline_s=QUEUE_LEN_DEADLINE_S),
                                      QUEUE_LEN_DEADLINE_S)  # fmt: skip
    except Exception:  # timeout, a dying replica: the stats are the best left
        return int((replica.routing_stats or {}).get("num_requests", 0))
