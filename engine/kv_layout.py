"""The KV cache's row formats, as the config sizes the pool and the cache stores them.

A row is one token's K (or V) for one KV head: ``head_dim`` values in the model dtype, or
for ``--kv-cache-dtype int8`` ``head_dim`` int8 values then a float16 scale
(engine/attention/kv_cache.py quantizes and reads them).
"""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "int8")
SCALE_BYTES = 2  # an int8 row's float16 scale, after its values


def kv_row_bytes(head_dim: int, dtype_bytes: int, quantized: bool) -> int:
    """Bytes of one (token, KV head) row of the cache."""
    return head_dim + SCALE_BYTES if quantized else head_dim * dtype_bytes
