"""The engine: model runner, paged attention, sampling, detokenization, offline API.

Names are imported lazily so that `import engine.sampler` does not load the
model loader and transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.config",
    "EngineStats": "engine.stats",
    "RequestOutput": "engine.outputs",
    "TokenLogprob": "engine.outputs",
    "SamplingParams": "scheduler.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
