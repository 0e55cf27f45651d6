"""Build the CPU kernels now (``python -m engine.kernels``), so no server start waits on it."""

from __future__ import annotations

import logging

from engine.kernels import (
    GGML_KERNEL_FLAGS,
    cpu_flags,
    cpu_kernels,
    cpu_kernels_supported,
    ggml_kernels,
    path_name,
    switch,
)

logging.basicConfig(level=logging.WARNING, format="%(message)s")
if not cpu_kernels_supported():
    why = (
        f"$PAGEDSERVE_CPU_KERNELS={switch()}"
        if switch() != "auto"
        else "this CPU has no AVX512-BF16"
    )
    print(f"CPU kernels: AVX-512 build skipped ({why}: bf16 takes torch's ops)")
elif cpu_kernels() is None:
    print("CPU kernels: build failed (see the warning above); torch's ops serve")
else:
    print("CPU kernels: built")
if not cpu_flags() >= GGML_KERNEL_FLAGS:
    print("GGUF kernels: not built (no AVX2/FMA/F16C; GGUF weights are dequantized at load)")
elif ggml_kernels() is None:
    print("GGUF kernels: build failed (see the warning above); GGUF weights are dequantized")
else:
    print(
        f"GGUF kernels: built, {path_name(ggml_kernels())} (with the float32 layer ops and "
        "decode stack that serve them)"
    )
