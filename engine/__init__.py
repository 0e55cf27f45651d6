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
# a load generator beside the server), so they do not spin for long: libgomp's default
# is up to ~3 ms. But not at all (PASSIVE alone) makes every one of a step's hundreds of
# parallel regions wait for a futex wake-up: a short spin (GOMP_SPINCOUNT, libgomp's
# knob, which it honours over the policy) made the batch-1 decode step 1.75x faster
# (8.7 vs 15.3 ms) on a 2-core VM. Both are read once when torch loads its OpenMP
# runtime, so they only take effect when engine is imported before torch; a user's
# setting wins. `OPENMP_DEFAULTS_SET` holds the ones set here, which a program this
# process starts (`bench compare`'s peers, which may use OpenMP too) must not inherit.
OPENMP_DEFAULTS_SET = {
    key: value
    for key, value in {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}.items()
    if key not in os.environ
}
os.environ.update(OPENMP_DEFAULTS_SET)

# oneDNN keeps a compiled primitive per GEMM shape, and torch's mkldnn matmul (ideep)
# another cache of them, each up to 1,024 entries by default: a bf16 prefill is a GEMM
# with M = its token count, so every new prompt length added entries of ~0.5 MB until
# both were full. Server RSS grew 993 / 1,197 / 1,406 / 1,538 / 1,592 MiB over 5 rounds
# of 120 prompts of 1-700 words (bench/rss_rounds.py); in-process, glibc's in-use bytes
# grew 70 MB a round, and with both caches small they stayed at 142 MB and RSS flat
# (790 / 773 / 773 MiB). Decode batches of 1-4 rows take the native kernels, so a few
# dozen entries hold every shape that repeats. Read when oneDNN/ideep first use them.
MATMUL_CACHE_DEFAULTS_SET = {
    key: value
    for key, value in {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}.items()
    if key not in os.environ
}
os.environ.update(MATMUL_CACHE_DEFAULTS_SET)

# $PAGEDSERVE_CPU_KERNELS=avx2 or avx512_vnni (engine.kernels: an AVX2-only CPU's or a Cascade
# Lake's path on a later machine) holds torch's own ops to that ISA as well, so the path is
# served as such a CPU serves it. Read when torch loads, so only where engine is imported
# first; a user's setting wins.
_TORCH_ISA = {"avx2": ("avx2", "AVX2"), "avx512_vnni": ("avx512", "AVX512_CORE_VNNI")}
if _isa := _TORCH_ISA.get(os.environ.get("PAGEDSERVE_CPU_KERNELS", "").strip().lower()):
    os.environ.setdefault("ATEN_CPU_CAPABILITY", _isa[0])
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _isa[1])

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.config",
    "EngineStats": "engine.stats",
    "RequestOutput": "engine.outputs",
    "TokenLogprob": "engine.outputs",
    "SamplingParams": "scheduler.sampling_params",
    "StructuredOutputs": "scheduler.structured_outputs",
    "ThinkingBudget": "scheduler.thinking_budget",
    "fits_context": "scheduler.config",
    "StepError": "engine.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
