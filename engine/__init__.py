"""The engine: model runner, paged attention, sampling, detokenization, offline API.

Names are imported lazily so that `import engine.sampler` does not load the
model loader and transformers.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# OpenMP threads that spin while waiting for a descheduled sibling made a decode step
# 5-8x slower on a busy 2-core machine (55 ms passive vs 317 ms spinning, measured with
# a load generator beside the server). Read once when torch loads its OpenMP runtime, so
# it only takes effect when engine is imported before torch; a user's setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.config",
    "EngineStats": "engine.stats",
    "RequestOutput": "engine.outputs",
    "TokenLogprob": "engine.outputs",
    "SamplingParams": "scheduler.sampling_params",
    "fits_context": "scheduler.config",
    "StepError": "engine.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
