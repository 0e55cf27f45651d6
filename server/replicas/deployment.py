"""The Ray Serve application: engine replicas behind the OpenAI-compatible ingress.

    serve run deploy/ray-serve.yaml                  # Ray Serve's own config file
    pagedserve serve --data-parallel-size 2          # the same, on a local Ray instance

`build(args)` is the application builder both use. `args` (all optional):
``num_replicas`` (2), ``router`` ("prefix": `PrefixAwareRouter`; "default": Ray Serve's
power of two choices), ``max_load_gap`` (the prefix router's), ``engine`` (EngineConfig
fields, e.g. ``{"model": "/models/x", "num_blocks": 512}``), ``server`` (the HTTP app's
options: ``api_key``, ``served_model_name``, ``max_waiting_requests``, ...),
``replica_threads`` (torch threads per replica; default: the cores divided among the
replicas), ``gpus_per_replica`` (0; 1 on a GPU cluster: Ray places one replica per GPU).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from server.engine_client import EngineRequest
from server.replicas.kv_events import KVEventLog
from server.replicas.prefix_router import DEFAULT_MAX_LOAD_GAP, DefaultRouter, PrefixAwareRouter

# Requests in flight per replica before Ray Serve holds more back in the ingress: the
# engine batches them itself, so the limit is the engine's, not Ray Serve's default of 5.
MAX_ONGOING_PER_REPLICA = 256
ROUTING_STATS_PERIOD_S = 1.0


@serve.deployment
class EngineReplica:
    """One engine (the single server's `AsyncEngine` bridge) and its KV event log."""

    async def __init__(self, engine_kwargs: dict[str, Any]) -> None:
        from engine import EngineConfig
        from engine.core import EngineCore
        from server.async_engine import AsyncEngine

        self.kv_events = KVEventLog()
        # SHA-256 block hashes: the router hashes prompts in another process.
        config = EngineConfig(**{**engine_kwargs, "prefix_cache_hash": "sha256"})
        self.client = AsyncEngine.load(lambda: EngineCore.from_config(config, self.kv_events))
        await self.client.start()
        self.core = self.client.core

    async def describe(self) -> dict[str, Any]:
        core = self.core
        return {
            "model_name": core.model_name,
            "max_model_len": core.max_model_len,
            "vocab_size": core.vocab_size,
            "eos_token_ids": sorted(core.eos_token_ids),
            "block_size": core.block_size,
        }

    async def generate(self, requests: list[EngineRequest]) -> AsyncIterator[list[Any]]:
        """An empty batch once the engine accepted the requests, then their outputs. Ray
        Serve cancels this generator when the caller goes away: `finally` aborts."""
        specs = {r.params.structured_outputs for r in requests} - {None}
        for spec in specs:  # on this replica's compile thread, never its engine thread
            await self.client.compile_grammar(spec)
        stream = await self.client.submit(requests)
        try:
            yield []
            async for out in stream:
                yield [out]
        finally:
            stream.abort()

    def record_routing_stats(self) -> dict[str, Any]:
        """What the routers learn about this replica, about every second."""
        body, _ = self.client.metrics.render()
        return {
            "time": time.time(),
            "num_requests": self.client.num_in_flight,
            "num_waiting": self.client.num_waiting,
            "kv_events": self.kv_events.window(),
            "metrics": body.decode(),
        }


@serve.deployment
@serve.ingress()
class Ingress:
    """The single server's HTTP app, its engine client talking to the replicas."""

    def __init__(self, replicas: DeploymentHandle, engine_kwargs: dict[str, Any],
                 server_kwargs: dict[str, Any]) -> None:  # fmt: skip
        self._replicas = replicas
        self._engine_kwargs = engine_kwargs
        self._server_kwargs = server_kwargs

    async def __serve_build_asgi_app__(self) -> Any:
        from engine.loader import load_tokenizer, resolve_model_dir
        from engine.template_bounds import DEFAULT_TIMEOUT_S
        from server.app import build_app
        from server.replicas.remote_engine import RemoteEngine

        facts = await self._replicas.describe.remote()
        model_dir = resolve_model_dir(self._engine_kwargs.get("model"),
                                      self._engine_kwargs.get("cache_dir"))  # fmt: skip
        engine = RemoteEngine(self._replicas, load_tokenizer(model_dir), facts)
        timeout = self._engine_kwargs.get("chat_template_timeout", DEFAULT_TIMEOUT_S)
        return build_app(engine, **self._server_kwargs, chat_template_timeout=timeout)


def build(args: dict[str, Any]) -> Any:
    """Ray Serve's application builder (`serve run`'s `import_path`)."""
    num_replicas = int(args.get("num_replicas", 2))
    engine_kwargs = dict(args.get("engine") or {})
    threads = args.get("replica_threads") or max(1, (os.cpu_count() or 1) // num_replicas)
    if args.get("router", "prefix") == "prefix":
        router = RequestRouterConfig(
            request_router_class=PrefixAwareRouter,
            request_router_kwargs={
                "block_size": engine_kwargs.get("block_size", 16),
                "max_load_gap": args.get("max_load_gap", DEFAULT_MAX_LOAD_GAP),
            },
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        )
    else:
        router = RequestRouterConfig(request_router_class=DefaultRouter,
                                     request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)  # fmt: skip
    replicas = EngineReplica.options(
        num_replicas=num_replicas,
        max_ongoing_requests=MAX_ONGOING_PER_REPLICA,
        request_router_config=router,
        # The engine sizes its own threads; Ray's CPU accounting would only refuse to
        # place N replicas on a machine of fewer than N cores.
        ray_actor_options={"num_cpus": 0, "num_gpus": float(args.get("gpus_per_replica", 0)),
                           "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}},
    ).bind(engine_kwargs)  # fmt: skip
    ingress = Ingress.options(
        max_ongoing_requests=MAX_ONGOING_PER_REPLICA * num_replicas,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(replicas, engine_kwargs, dict(args.get("server") or {}))
