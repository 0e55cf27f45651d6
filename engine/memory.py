"""Giving the C heap's free pages back to the system when the engine goes idle.

glibc keeps freed memory in its arenas (one per thread that allocates: the engine thread,
OpenMP workers, the event loop) and rarely returns it. With prompts of many lengths that
held RSS up: `python -m bench.rss_rounds` (issue 29, item 4) grew +396 MiB from round 2
to 5, and +263 MiB with only a `malloc_trim(0)` every 0.5 s; the rest was the matmul
shape caches bounded in engine/__init__.py. The server calls this once per busy period,
when the engine has nothing left to do (its cost was not measured separately).
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
