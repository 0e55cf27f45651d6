"""Giving the C heap's free pages back to the system when the engine goes idle.

Prompts of many lengths leave glibc's arenas (one per thread that allocates: the engine
thread, OpenMP workers, the event loop) holding freed prefill-sized buffers that the next
busy period cannot always reuse, so RSS grew round after round (issue 29, item 4; measured
with `python -m bench.rss_rounds`). `malloc_trim(0)` returns those pages; it costs about a
millisecond, so it runs once per busy period, when the engine has nothing left to do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache


@lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's `malloc_trim`, or None (musl, macOS: nothing to call)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Return the C heap's free pages to the system; True if glibc released any."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
