"""Paged attention over a block-structured KV cache, on flat (unpadded) token batches.

A step's tokens are the requests' new tokens concatenated. Query ``i`` of a request
with query length ``L`` and context length ``S`` sits at position ``S - L + i`` and
attends to keys ``0 .. S - L + i`` (causal over cached prefix + new tokens); a decode
is simply ``L == 1``.

* `metadata.py`: `AttentionMetadata`, the step's batch layout, and its `build`.
* `kv_cache.py`: the per-layer K/V cache tensors: `allocate_kv_cache`, `write_kv`,
  `gather_request_kv`.
* `backend.py`: `AttentionBackend`, the interface: ``prepare(meta)`` once per step
  (all host-side planning), then ``backend(q, k_cache, v_cache, meta, scale)`` per
  layer (tensor work only).
* `reference.py`: ``reference``, per-request float32 attention, the tests' oracle.
* `decode_plan.py`: how the SDPA backend groups a step's decodes, cascades over
  shared prefixes included.
* `sdpa.py`: ``sdpa`` (what "auto" picks where neither cpu-paged nor triton serves) and
  ``sdpa-nocascade``.
* `cpu_paged.py`: ``cpu-paged`` (the default for bf16 on CPUs with AVX512-BF16): decodes
  through the paged decode kernel in `engine/kernels`.
* `registry.py`: the backends by name and `get_attention_backend`.

bench/attention_bench.py compares the backends with the alternatives and
bench/attention.md has the numbers.
"""

from engine.attention.backend import AttentionBackend
from engine.attention.cpu_paged import CpuPagedBackend
from engine.attention.decode_plan import CascadeGroup, cascade_groups
from engine.attention.kv_cache import allocate_kv_cache, write_kv
from engine.attention.metadata import AttentionMetadata
from engine.attention.reference import ReferenceBackend, reference_paged_attention
from engine.attention.registry import ATTENTION_BACKENDS, DEFAULT_BACKEND, get_attention_backend
from engine.attention.sdpa import SdpaBackend, attention_with_lse, attention_with_lse_ops

__all__ = [
    "ATTENTION_BACKENDS",
    "DEFAULT_BACKEND",
    "AttentionBackend",
    "AttentionMetadata",
    "CascadeGroup",
    "CpuPagedBackend",
    "ReferenceBackend",
    "SdpaBackend",
    "allocate_kv_cache",
    "attention_with_lse",
    "attention_with_lse_ops",
    "cascade_groups",
    "get_attention_backend",
    "reference_paged_attention",
    "write_kv",
]
