"""Attention backends by name, and the one "auto" picks."""

from __future__ import annotations

from functools import partial
from typing import Any

from engine.attention.backend import AttentionBackend
from engine.attention.cpu_paged import CpuPagedBackend
from engine.attention.reference import ReferenceBackend
from engine.attention.sdpa import SdpaBackend
from engine.registry import ATTENTION_BACKENDS


def _triton_backend(
    num_heads: int, num_kv_heads: int, window: int | None = None
) -> AttentionBackend:
    # Imported on use: triton comes with torch's CUDA build, and loading it costs a second.
    from engine.attention.triton_paged import TritonBackend

    return TritonBackend(num_heads, num_kv_heads, window)


# name -> factory of (num_heads, num_kv_heads), in engine/registry.py's ATTENTION_BACKENDS
# (which the config validates against): each model gets its own backend object, since a
# backend keeps the plan of the step it last prepared.
ATTENTION_BACKENDS.add("reference", ReferenceBackend)
ATTENTION_BACKENDS.add("sdpa", SdpaBackend)
# Every decode over its whole context, shared prefixes or not: for A/B runs.
ATTENTION_BACKENDS.add("sdpa-nocascade", partial(SdpaBackend, cascade=False))
# bf16 on CPUs with AVX512-BF16, float32 on a GGUF's blocks: decodes through the paged
# decode kernel.
ATTENTION_BACKENDS.add("cpu-paged", CpuPagedBackend)
# Triton kernels over the block table (CUDA, where "auto" picks it; on CPU only under
# TRITON_INTERPRET=1, as the tests run them).
ATTENTION_BACKENDS.add("triton", _triton_backend)

# "auto" resolves to this unless `cpu-paged` can run, or on CUDA `triton`: the execution
# plan decides it (engine/execution_plan.py); see bench/attention.md.
DEFAULT_BACKEND = "sdpa"


def backend_class(name: str) -> type[AttentionBackend]:
    """The class a registered backend's factory builds (what the plan reads its traits from)."""
    if name == "triton":
        from engine.attention.triton_paged import TritonBackend

        return TritonBackend
    factory = ATTENTION_BACKENDS[name]
    return factory.func if isinstance(factory, partial) else factory  # type: ignore[return-value]


def cpu_paged_fits(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the paged decode kernel handles this head layout: head_dim a multiple of 16
    up to 256, at most 16 query heads per KV head. (It also needs the CPU kernels for the
    model's dtype: the plan checks that.)"""
    return head_dim % 16 == 0 and head_dim <= 256 and num_heads // num_kv_heads <= 16


def get_attention_backend(
    name: str, num_heads: int, num_kv_heads: int, window: int | None = None, **options: Any
) -> AttentionBackend:
    """A new backend ``name`` (a registered one, as the execution plan resolved it) for this
    head layout and sliding window (None: full attention): each KV cache group of a model
    gets its own, since a backend keeps the plan of its last step. ``options``: the
    backend's own (cpu-paged's ``every_query_as_rows``)."""
    factory = ATTENTION_BACKENDS[name]  # ValueError naming the choices
    if window is not None and not backend_class(name).sliding_windows:
        raise ValueError(f"the {name} attention backend has no sliding window")
    backend = factory(num_heads, num_kv_heads, window=window, **options)
    backend.name = name
    return backend
