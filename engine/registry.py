"""The engine's pluggable parts by kind, each filled by the module that implements them.

`EngineConfig` validates ``--attention-backend`` and ``--quantization`` against these and the
command line lists them, without importing the implementations: a registry imports its
provider module (which registers every entry) the first time it is read. So the config
stays below the code it configures, and adding a backend or a weight format never touches
it: the new module registers itself (attention backends in engine/attention/registry.py,
weight formats with `@register` in engine/quantization/).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, provider: str) -> None:
        self.kind = kind  # for messages: "attention backend", "quantization"
        self.provider = provider  # the module whose import registers every entry
        self._entries: dict[Any, T] = {}
        self._loaded = False

    def add(self, name: Any, entry: T) -> T:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = entry
        return entry

    def register(self, name: Any) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name")`` on what serves that name."""
        return lambda entry: self.add(name, entry)

    def _all(self) -> dict[Any, T]:
        if not self._loaded:
            importlib.import_module(self.provider)  # a module already importing returns
            self._loaded = True
        return self._entries

    def names(self, where: Callable[[T], bool] | None = None) -> tuple[str, ...]:
        """The registered names (in registration order), those ``where`` accepts if given."""
        return tuple(n for n, e in self._all().items() if n is not None and (not where or where(e)))

    def __getitem__(self, name: Any) -> T:
        entries = self._all()
        if name not in entries:
            choices = ", ".join(self.names())
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of: {choices}")
        return entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._all()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._all())


ATTENTION_BACKENDS: Registry[Any] = Registry("attention backend", "engine.attention.registry")
QUANTIZATION_METHODS: Registry[Any] = Registry("quantization", "engine.quantization")
