"""The machine a benchmark ran on, in one line each: the CPU, its cores and Python, and the
CPU flags that decide how fast the kernels can be (for the reports' headers)."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()}"


# The CPU flags that decide how fast these servers' kernels can be: AVX2 / AVX-512 for
# float32 and quantized dot products, VNNI for int8 ones (llama.cpp), AVX512-BF16 and AMX
# for bfloat16 matmuls (pagedserve's dtype=auto picks bfloat16 with either).
SPEED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")


def cpu_flags_line(cpuinfo: str | None = None) -> str:
    """E.g. "avx2 yes, avx512f yes, avx512_vnni yes, avx512_bf16 no, amx_bf16 no", from
    /proc/cpuinfo's first `flags` line (`cpuinfo` for tests); "unknown" without one."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in SPEED_FLAGS)
    return "unknown"
