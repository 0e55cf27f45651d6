"""Starting a server of several models (`pagedserve serve --models-dir DIR`, or `--model`
given more than once): the models found, what each costs, the default and the pinned
models loaded before the server listens (server/cli.py's `run_serve` then serves them as
it serves one model).

Every model runs with the same engine flags (dtype, KV pool size, token budget...): only
`EngineConfig.model` differs between them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from engine.config import EngineConfig
from server.engine_client import EngineClient
from server.model_budget import ModelBudget, kv_pool_estimate
from server.model_registry import ModelEntry, ModelRegistry, find_models
from server.model_router import ModelRouter
from server.router_engine import RouterEngine


class EveryModel(argparse._StoreAction):
    """`--model` as a server of several models reads it: every use kept (in `models`, set
    only when the flag is given), in order; the engine's own `model` stays the first (the
    default model)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        namespace.models = [*(getattr(namespace, "models", None) or []), values]
        namespace.model = namespace.models[0]


def keep_every_model(parser: argparse.ArgumentParser) -> None:
    """Make the engine's `--model` flag repeatable (see `EveryModel`)."""
    for action in parser._actions:
        if "--model" in action.option_strings:
            action.__class__ = EveryModel


def several_models(server: Any, given: list[str] | None) -> tuple[str, ...] | None:
    """The `--model` paths of a server of several models (--models-dir, or --model given
    more than once), None for a single-model server; ValueError for an option that only
    the other kind takes."""
    models = tuple(given or ())
    several = server.models_dir is not None or len(models) > 1
    needs = "needs --models-dir or --model given more than once"
    checks = [
        (several or server.max_loaded_models is None, "max_loaded_models", needs),
        (several or server.models_memory is None, "models_memory", needs),
        (several or not server.pin, "pin", needs),
        (not several or server.served_model_name is None, "served_model_name",
         "names the one model of a single-model server; several models are each named "
         "after their file or folder"),
        (not several or server.data_parallel_size == 1, "data_parallel_size",
         "replicas serve one model; several models are served by one process"),
    ]  # fmt: skip
    for ok, name, message in checks:
        if not ok:
            raise ValueError(f"{name} {message}")
    return models if several else None


def start_models(
    server: Any,
    engine: EngineConfig,
    models: tuple[str, ...],
    build: Callable[[EngineConfig, Any], EngineClient],
) -> tuple[RouterEngine, ModelRouter]:
    """The router over `models` and those of `server.models_dir`, its default and pinned
    models loaded (`build(config, tokenizer)` loads one, with the tokenizer of its last
    load or None); ValueError naming what is wrong (a bad directory, an unknown pin, a
    default model that does not load or fit)."""
    registry = ModelRegistry(find_models(server.models_dir, models))
    for entry in registry:
        entry.kv_bytes = kv_pool_estimate(_config_of(engine, entry))
    for name in server.pin:
        registry.named(name).pinned = True
    budget = ModelBudget(server.max_loaded_models, server.models_memory)
    router = ModelRouter(
        registry, lambda entry: build(_config_of(engine, entry), entry.tokenizer), budget
    )
    for entry in [registry.default, *(e for e in registry if e.pinned)]:
        if entry.client is None:
            _load_at_start(router, entry)
    return RouterEngine(router), router


def _config_of(engine: EngineConfig, entry: ModelEntry) -> EngineConfig:
    return replace(engine, model=entry.path)


def _load_at_start(router: ModelRouter, entry: ModelEntry) -> None:
    try:
        router.load_now(entry)
    except (ValueError, OSError) as exc:
        raise ValueError(f"model {entry.name} ({entry.path}) cannot load at start: {exc}") from exc


def models_banner(router: ModelRouter, host: str, port: int) -> str:
    """The start-up lines of a server of several models."""
    registry = router.registry
    pinned = [e.name for e in registry if e.pinned]
    return (
        f"pagedserve: {len(registry)} models ({', '.join(registry.names)}), default "
        f"{registry.default.name}, loaded: {', '.join(e.name for e in router.loaded())}"
        + (f", pinned: {', '.join(pinned)}" if pinned else "")
        + f"; budget: {router.budget.describe()}\n"
        f"pagedserve: serving the OpenAI API at http://{host}:{port}/v1 (each request by its "
        "`model`; Ctrl-C or SIGTERM drains and stops)"
    )
