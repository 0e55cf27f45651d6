"""The budget several models share (`--max-loaded-models`, `--models-memory`): what a
model costs, whether one more fits, and which model makes room.

A model costs its weight files' bytes plus its KV pool. The pool is known exactly once
the model has loaded (its blocks x the bytes of a block); before that it is estimated as
the engine would size it: `--kv-cache-memory`, or `--num-blocks` x a block of the
model's shape (read from its config.json or GGUF metadata), or the CPU default budget.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import CPU_KV_MAX_FRACTION, EngineConfig
from engine.default_model import DEFAULT_MODEL_NAME
from engine.device import CPU_DEFAULT_KV_BYTES, available_ram
from server.model_registry import ModelEntry, ModelState, model_file

logger = logging.getLogger(__name__)

GiB = 1 << 30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # "auto": float32's, the most


@dataclass(frozen=True)
class ModelBudget:
    """None: no limit of that kind."""

    max_loaded: int | None = None
    memory_bytes: int | None = None

    def too_large(self, entry: ModelEntry) -> str | None:
        """Why this model can never load within the budget (alone), or None."""
        if self.memory_bytes is None or entry.memory_bytes <= self.memory_bytes:
            return None
        return (
            f"model {entry.name} needs about {_size(entry.memory_bytes)} (weights "
            f"{_size(entry.weights_bytes)} + KV pool {_size(entry.kv_bytes)}), more than "
            f"--models-memory {_size(self.memory_bytes)} holds; raise --models-memory or give "
            "it a smaller KV pool (--kv-cache-memory)"
        )

    def fits(self, entry: ModelEntry, resident: list[ModelEntry]) -> bool:
        """Whether `entry` can load beside the resident models."""
        others = [e for e in resident if e is not entry]
        if self.max_loaded is not None and len(others) + 1 > self.max_loaded:
            return False
        used = sum(e.memory_bytes for e in others)
        return self.memory_bytes is None or used + entry.memory_bytes <= self.memory_bytes

    def describe(self) -> str:
        parts = []
        if self.max_loaded is not None:
            parts.append(f"--max-loaded-models {self.max_loaded}")
        if self.memory_bytes is not None:
            parts.append(f"--models-memory {_size(self.memory_bytes)}")
        return " and ".join(parts) or "no limit"


def eviction_candidates(resident: list[ModelEntry], keep: ModelEntry) -> list[ModelEntry]:
    """The loaded models that may be unloaded to make room for `keep`, first choice first:
    idle ones before busy ones (a busy one is drained first), each by least recent use."""
    movable = [e for e in resident
               if e is not keep and e.state is ModelState.LOADED and not e.pinned]  # fmt: skip
    return sorted(movable, key=lambda e: (e.num_in_flight > 0, e.last_used))


def kv_pool_estimate(config: EngineConfig) -> int:
    """The bytes of the KV pool the engine would allocate for `config.model`."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if config.num_blocks is None:
        return min(CPU_DEFAULT_KV_BYTES, int(available_ram() * CPU_KV_MAX_FRACTION))
    shape = _kv_shape(model_file(config.model or DEFAULT_MODEL_NAME))
    if shape is None:  # measured once it has loaded
        return 0
    per_block = config.kv_cache_bytes_per_block(*shape, _DTYPE_BYTES.get(config.dtype, 4))
    return config.num_blocks * per_block


def measured_kv_bytes(client: Any) -> int | None:
    """The KV pool a loaded in-process engine allocated (None: not in this process)."""
    core = getattr(client, "core", None)
    if core is None:
        return None
    engine = core.config.engine
    per_block = engine.kv_cache_bytes_per_block(
        core.config.num_layers, core.model.num_kv_heads, core.model.head_dim,
        core.dtype.itemsize,
    )  # fmt: skip
    return core.num_blocks * per_block


def _kv_shape(path: Path) -> tuple[int, int, int] | None:
    """(layers, KV heads, head dim) from a model folder's config.json or a GGUF's metadata."""
    try:
        if path.is_dir():
            return _hf_shape(json.loads((path / "config.json").read_text(encoding="utf-8")))
        if path.suffix == ".gguf":
            return _gguf_shape(path)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        logger.info("cannot read the KV shape of %s (%s): measured when it loads", path, exc)
    return None


def _hf_shape(cfg: dict[str, Any]) -> tuple[int, int, int]:
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    return int(cfg["num_hidden_layers"]), kv_heads, head_dim


def _gguf_shape(path: Path) -> tuple[int, int, int]:
    from engine.gguf_file import GGUFFile

    meta = GGUFFile(path).metadata
    arch = meta["general.architecture"]
    heads = int(meta[f"{arch}.attention.head_count"])  # type: ignore[call-overload]
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))  # type: ignore[call-overload]
    width = int(meta[f"{arch}.embedding_length"])  # type: ignore[call-overload]
    head_dim = int(meta.get(f"{arch}.attention.key_length", width // heads))  # type: ignore[call-overload]
    return int(meta[f"{arch}.block_count"]), kv_heads, head_dim  # type: ignore[call-overload]


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / (1 << 20):.1f} MiB"
