"""The device-specific calls the engine makes, and the device's memory.

Engine code names no device: it receives a `torch.device` (`resolve_device`) and calls
these helpers where CPU and CUDA differ, so the same code path runs on both
(tests/test_device_agnostic.py enforces it). The KV cache's share of a GPU is measured
here too, around a profiling forward pass.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

import torch

GiB = 1 << 30
# Without an explicit budget the CPU KV cache gets 2 GiB (engine/config.py); an unknown
# amount of free RAM trusts that default.
CPU_DEFAULT_KV_BYTES = 2 * GiB


def resolve_device(name: str) -> torch.device:
    """ "auto" (CUDA where available, else the CPU), or the device named; ValueError for a
    CUDA device without CUDA."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available")
    return device


def valid_device_name(name: object) -> bool:
    if not isinstance(name, str):
        return False
    if name in ("auto", "cpu", "cuda"):
        return True
    prefix, _, index = name.partition(":")
    return prefix == "cuda" and index.isdigit()


# -- GPU memory: the KV cache's share, measured around a profiling forward pass ----------------


class GpuMemory(NamedTuple):
    """One CUDA device's memory as the KV cache sizing sees it, in bytes."""

    total: int
    # In use at the peak of the profiling forward pass (weights + the largest step's
    # activations + the CUDA context + other processes on the device).
    peak_used: int


def gpu_kv_cache_budget(total: int, peak_used: int, gpu_memory_utilization: float) -> int:
    """The KV cache's bytes on a GPU, as vLLM sizes it.

    The engine may fill `gpu_memory_utilization` of the device's `total` memory; the KV cache
    gets what is left of that share after everything in use at the profiling peak. Negative
    when the share is already exceeded (the caller reports it).
    """
    return int(total * gpu_memory_utilization) - peak_used


def measure_gpu_memory(device: torch.device) -> GpuMemory:
    """The device's total memory and its use at the peak since `reset_peak_memory_stats`.

    Memory in use now is total minus free, as the driver reports it (this process's
    allocations and cache, its CUDA context, other processes). If the caching allocator has
    since given memory back (an `empty_cache` after the profiling pass), the difference
    between its peak and current reservation is added back: the next step of that size will
    need it again.
    """
    free, total = torch.cuda.mem_get_info(device)
    released = torch.cuda.max_memory_reserved(device) - torch.cuda.memory_reserved(device)
    return GpuMemory(total=total, peak_used=total - free + max(released, 0))


def is_cuda(device: torch.device) -> bool:
    """Whether the device is a CUDA GPU (where decode steps may replay CUDA graphs)."""
    return device.type == "cuda"


def is_cpu(device: torch.device) -> bool:
    """Whether the device is the host CPU (where the native kernels of engine/kernels run)."""
    return device.type == "cpu"


def gpu_has_bf16(device: torch.device) -> bool:
    """Whether a CUDA device computes bf16 natively (Ampere and later)."""
    return is_cuda(device) and torch.cuda.is_bf16_supported()


def reset_peak_memory_stats(device: torch.device) -> None:
    """Start a new peak measurement (before the profiling pass); nothing to do on CPU."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (before reading memory figures or timings)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def uses_pinned_memory(device: torch.device) -> bool:
    """Whether host staging buffers for this device should be pinned (page-locked).

    Only a copy from pinned memory to a CUDA device runs asynchronously with
    `non_blocking=True`; on CPU pinning buys nothing (and needs a CUDA build).
    """
    return device.type == "cuda" and torch.cuda.is_available()


def available_ram() -> int:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if sys.platform != "win32" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            pass
    return CPU_DEFAULT_KV_BYTES  # unknown: trust the default budget
