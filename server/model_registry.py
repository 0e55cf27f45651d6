"""The models one server can serve (`--models-dir`, `--model` given several times): their
names, files and states.

A model is a `.gguf` file or a Hugging Face model folder (one holding a config.json) in
the directory, or a path given to `--model`; its name is the file's name without `.gguf`
or the folder's name, as a single-model server names it (EngineConfig.served_name). The
registry only lists and looks up; server/model_router.py owns every state change.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from enum import Enum
from http import HTTPStatus
from pathlib import Path
from typing import Any

from engine.default_model import DEFAULT_MODEL_NAME
from server.errors import NOT_FOUND, OpenAIError

WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin")


class ModelState(str, Enum):
    """What /v1/models reports for a model (its `status.value`)."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"  # draining its requests; loads again when asked for
    FAILED = "failed"  # its load failed: `error` says why; POST /models/load retries


@dataclass(eq=False)
class ModelEntry:
    """One servable model. Changed only by the router, on the event loop."""

    name: str
    path: str  # what EngineConfig.model is set to for it
    weights_bytes: int  # its files' size: the weights' share of the memory budget
    kv_bytes: int = 0  # its KV pool: estimated before its first load, measured after
    pinned: bool = False
    state: ModelState = ModelState.UNLOADED
    error: OpenAIError | None = None  # why it failed (state FAILED)
    client: Any = None  # its EngineClient while loaded (and while unloading)
    context: Any = None  # its ServingContext while loaded
    leases: int = 0  # requests between routing and handing their work to the engine
    last_used: float = field(default_factory=time.monotonic)
    transition: Any = None  # the asyncio task loading or unloading it, awaited by requests
    load_seconds: float | None = None  # its last load's duration
    # Kept while it is unloaded, for its next load: reading it again was most of a small
    # model's load (~0.45 s of 0.5 s), and it weighs little beside the weights.
    tokenizer: Any = None

    @property
    def memory_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes

    @property
    def is_resident(self) -> bool:
        """Holds (or is about to hold) memory: counted against the budget."""
        return self.state in (ModelState.LOADING, ModelState.LOADED, ModelState.UNLOADING)

    @property
    def num_in_flight(self) -> int:
        """Requests routed to it that have not ended: the ones an unload waits for."""
        engine = 0 if self.client is None else self.client.num_in_flight
        return self.leases + engine


class ModelRegistry:
    """The models by name, in the order they were found (the first is the default)."""

    def __init__(self, entries: list[ModelEntry]) -> None:
        if not entries:
            raise ValueError("no models to serve: the models directory holds no .gguf file or "
                             "model folder")  # fmt: skip
        self._entries: dict[str, ModelEntry] = {}
        for entry in entries:
            if entry.name in self._entries:
                raise ValueError(
                    f"two models are named {entry.name!r} ({self._entries[entry.name].path} "
                    f"and {entry.path}); rename one"
                )
            self._entries[entry.name] = entry
        self.default = entries[0]

    def __iter__(self):  # noqa: ANN204 - an iterator of entries
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def find(self, name: str | None) -> ModelEntry:
        """The model a request names (None: the default), by its name or a GGUF's file
        name (`x.gguf`, as clients of llama-server may send it); an OpenAI 404 if none is."""
        if name is None:
            return self.default
        entry = self._entries.get(name) or self._entries.get(name.removesuffix(".gguf"))
        if entry is None:
            shown = ", ".join(self.names[:20]) + (", ..." if len(self) > 20 else "")
            raise OpenAIError(
                HTTPStatus.NOT_FOUND,
                f"The model `{name}` does not exist. This server serves: {shown}.",
                type=NOT_FOUND,
                param="model",
                code="model_not_found",
            )
        return entry

    def named(self, name: str) -> ModelEntry:
        """The model named `name` by a start-up option; ValueError if there is none."""
        if name not in self._entries:
            raise ValueError(f"no model is named {name!r}; the models are {', '.join(self.names)}")
        return self._entries[name]


def model_name(path: str) -> str:
    """A model's name from its path, as a single-model server names it."""
    return Path(path).expanduser().name.removesuffix(".gguf")


def model_file(path: str) -> Path:
    """Where a model's files are: its path, or the embedded default model's GGUF for its
    name (which `--model` also takes)."""
    if path == DEFAULT_MODEL_NAME:
        from engine.loader import default_gguf_path

        with contextlib.suppress(FileNotFoundError):
            return default_gguf_path()
    return Path(path).expanduser()


def weights_bytes(path: Path) -> int:
    """The bytes a model's weight files hold (0 when there are none to see)."""
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir()
                   if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))  # fmt: skip
    return 0


def _is_model(path: Path) -> bool:
    if path.name.startswith("."):
        return False
    if path.is_file():
        return path.suffix == ".gguf"
    return path.is_dir() and (path / "config.json").is_file()


def find_models(models_dir: str | None, model_paths: tuple[str, ...]) -> list[ModelEntry]:
    """The `--model` paths (in their order: the first is the default), then every model of
    `models_dir` in name order; ValueError when the directory cannot be read."""
    paths = list(model_paths)
    if models_dir is not None:
        folder = Path(models_dir).expanduser()
        if not folder.is_dir():
            raise ValueError(f"models_dir {models_dir!r} is not a directory")
        given = {Path(p).expanduser().resolve() for p in model_paths}
        paths += [str(p) for p in sorted(folder.iterdir())
                  if _is_model(p) and p.resolve() not in given]  # fmt: skip
    return [ModelEntry(model_name(p), p, weights_bytes(model_file(p))) for p in paths]
