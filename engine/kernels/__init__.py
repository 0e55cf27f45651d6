"""Native CPU kernels, compiled on first use by torch's C++ extension loader.

`cpu_kernels()` returns the compiled module, or None where it cannot run (no AVX512-BF16,
no C++ compiler): callers then use torch's own ops, which are always correct. The build
(about a minute, once per Python environment; `make` does it at install time with ``python -m
engine.kernels``) lands in torch's extension cache, ``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``, under a name keyed by the environment: two virtualenvs
sharing that cache would otherwise rebuild it in turn, each build waiting on the other's
lock.

* ``skinny_linear(x, weight, scales, bias)``: decode-sized matmuls (`csrc/skinny_gemm.cpp`)
* ``paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)``: decode
  attention straight from the paged cache (`csrc/paged_decode.cpp`)
* ``add_rms_norm``, ``rope_write_kv``, ``silu_mul``: the small ops around a bf16 layer's
  matmuls, one call each (`csrc/fused_ops.cpp`)
* ``DecodeStack``: a decode-only step's decoder layers in one call, through the kernels
  above (`csrc/decode_stack.cpp`)
* ``apply_token_bitmask_(logits, bitmask, rows)``: a grammar's allowed tokens on float32
  logits, -inf elsewhere (`csrc/token_bitmask.cpp`)

* ``ggml_dequantize``, ``ggml_linear``: GGUF weights served from their own blocks
  (`csrc/ggml_quants.cpp`), also a `DecodeStack` projection

`ggml_kernels()` is the module with the GGUF kernels: this one, or on a CPU with AVX2 but
not AVX512-BF16 a build of `csrc/ggml_quants.cpp` alone.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    "bindings.cpp",
    "skinny_gemm.cpp",
    "paged_decode.cpp",
    "fused_ops.cpp",
    "decode_stack.cpp",
    "token_bitmask.cpp",
    "ggml_quants.cpp",
)
# The flags the intrinsics need; the build targets exactly these, not -march=native, so a
# cached build stays valid on any CPU that has them.
CPU_KERNEL_FLAGS = frozenset(
    {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx2", "fma", "f16c"}
)
# (Every CPU with AVX512-BF16 has AVX512-VNNI: Cooper Lake, Sapphire Rapids, Zen 4 and 5.)
_ISA_CFLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mavx2",
               "-mfma", "-mf16c"]  # fmt: skip


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags Linux reports; empty elsewhere (then no kernel is assumed)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cpu_kernels_supported() -> bool:
    return cpu_flags() >= CPU_KERNEL_FLAGS


GGML_KERNEL_FLAGS = frozenset({"avx2", "fma", "f16c"})
# -ffp-contract=off: dequantization must round exactly as ggml does (no fused multiply-add
# the source does not write); the other kernels write their FMAs out as intrinsics.
_GGML_CFLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"]


def _build(name: str, sources: list[str], cflags: list[str]) -> ModuleType | None:
    """Compile (once, cached by torch) and load an extension; None where that fails."""
    try:
        from torch.utils.cpp_extension import load

        env = hashlib.sha256(f"{sys.prefix}|{torch.__version__}".encode()).hexdigest()[:10]
        return load(
            name=f"{name}_{env}",
            sources=[str(CSRC / source) for source in sources],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
        )
    except Exception as exc:  # no compiler, headers, ninja...: torch's ops still work
        logger.warning("CPU kernels %s unavailable, using torch's ops: %s", name, exc)
        return None


@lru_cache(maxsize=1)
def ggml_kernels() -> ModuleType | None:
    """The GGUF block kernels: the AVX-512 module's where it builds (its decode stack
    calls them), else an AVX2 build of them alone; None where the CPU lacks AVX2/FMA/F16C
    or they do not build (then a GGUF's weights are dequantized at load)."""
    if (kernels := cpu_kernels()) is not None:
        return kernels
    if not cpu_flags() >= GGML_KERNEL_FLAGS:
        return None
    return _build("pagedserve_ggml_kernels", ["ggml_quants.cpp", "ggml_bindings.cpp"], _GGML_CFLAGS)


@lru_cache(maxsize=1)
def cpu_kernels() -> ModuleType | None:
    """The compiled kernels, or None (then torch's ops serve, and a warning says why)."""
    if not cpu_kernels_supported():
        return None
    return _build("pagedserve_cpu_kernels", list(SOURCES), [*_GGML_CFLAGS, *_ISA_CFLAGS])


def host_kernels(device: torch.device | str) -> ModuleType | None:
    """The kernels for work on this device whatever the model's dtype (the sampler's float32
    logits), or None off the CPU or where they do not build."""
    return cpu_kernels() if torch.device(device).type == "cpu" else None


def bf16_cpu_kernels(dtype: torch.dtype, device: torch.device | str) -> ModuleType | None:
    """The kernels, when a model of this dtype on this device can use them (bf16 on a CPU
    where they build), else None: the one place that decides it."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return None
    return cpu_kernels()
