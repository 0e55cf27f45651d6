"""Attention backends by name, and the one "auto" picks."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.cpu_paged import CpuPagedBackend
from engine.attention.reference import ReferenceBackend
from engine.attention.sdpa import SdpaBackend
from engine.kernels import layer_kernels


def _triton_backend(num_heads: int, num_kv_heads: int) -> AttentionBackend:
    # Imported on use: triton comes with torch's CUDA build, and loading it costs a second.
    from engine.attention.triton_paged import TritonBackend

    return TritonBackend(num_heads, num_kv_heads)


# name -> factory of (num_heads, num_kv_heads): each model gets its own backend object,
# since a backend keeps the plan of the step it last prepared.
ATTENTION_BACKENDS: dict[str, Callable[[int, int], AttentionBackend]] = {
    "reference": ReferenceBackend,
    "sdpa": SdpaBackend,
    # Every decode over its whole context, shared prefixes or not: for A/B runs.
    "sdpa-nocascade": partial(SdpaBackend, cascade=False),
    # bf16 on CPUs with AVX512-BF16, float32 on a GGUF's blocks: decodes through the paged
    # decode kernel.
    "cpu-paged": CpuPagedBackend,
    # Triton kernels over the block table (CUDA, where "auto" picks it; on CPU only under
    # TRITON_INTERPRET=1, as the tests run them).
    "triton": _triton_backend,
}

# "auto" resolves to this unless `cpu-paged` can run (or, on CUDA, `triton`: the engine's
# `ResolvedConfig.attention_backend`); see bench/attention.md.
DEFAULT_BACKEND = "sdpa"


def cpu_paged_applies(
    dtype: torch.dtype,
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    quantization: str | None = None,
) -> bool:
    """Whether the cpu-paged backend can serve this model: where its layers run the CPU
    kernels (`engine.kernels.layer_kernels`: bf16 with AVX512-BF16, float32 on a GGUF's
    blocks), with a head layout the kernel handles (head_dim a multiple of 16 up to 256, at
    most 16 query heads per KV head)."""
    return (
        head_dim % 16 == 0
        and head_dim <= 256
        and num_heads // num_kv_heads <= 16
        and layer_kernels(dtype, device, quantization) is not None
    )


def get_attention_backend(
    name: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,  # None: torch's default device
    quantization: str | None = None,  # the model's (engine.models.linear)
) -> AttentionBackend:
    """A new backend ``name`` for this head layout, dtype, device and quantization; "auto"
    is cpu-paged where it can run (4-6x SDPA's decode attention) and SDPA elsewhere."""
    device = torch.device(device) if device is not None else torch.get_default_device()
    paged = cpu_paged_applies(dtype, device, num_heads, num_kv_heads, head_dim, quantization)
    auto = "cpu-paged" if paged else DEFAULT_BACKEND
    key = auto if name == "auto" else name
    try:
        factory = ATTENTION_BACKENDS[key]
    except KeyError:
        choices = ", ".join(["auto", *ATTENTION_BACKENDS])
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {choices}") from None
    if key == "cpu-paged" and not paged:
        raise ValueError(
            "attention backend 'cpu-paged' needs device cpu, dtype bfloat16 on a CPU with "
            "AVX512-BF16 or float32 on a GGUF's blocks (AVX2), head_dim a multiple of 16 up to "
            "256 and at most 16 query heads per KV head; got "
            f"{device}, {str(dtype).removeprefix('torch.')}, head_dim {head_dim}"
        )
    backend = factory(num_heads, num_kv_heads)
    backend.name = key
    return backend
