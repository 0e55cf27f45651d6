"""The paged KV cache tensors: allocated once, written each layer, gathered per request.

Per layer the cache is a K and a V tensor of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; a token's flat slot is
``block_id * block_size + offset`` (see `AttentionMetadata.slot_mapping`).

int8 (`--kv-cache-dtype int8`): each (token, KV head) row holds its head_dim values
quantized symmetrically to int8 and then its scale as float16 bytes, so the tensors are
``[num_blocks, block_size, num_kv_heads, head_dim + 2]`` int8: one row is head_dim + 2
bytes against 2 * head_dim in bf16 (1.94x the blocks at head_dim 64) and 4 * head_dim in
float32. Keeping the scale in the row keeps the cache one K and one V tensor per layer,
and a row is read in one place. value = int8 * scale, scale = max |x| / 127 (rounded to
float16 first, and the values quantized with that rounded scale, so dequantizing gives
exactly what was quantized against). The CPU kernels write and read the same layout
(csrc/kv_int8.h).
"""

from __future__ import annotations

import math
import mmap

import torch

from engine.kv_layout import KV_CACHE_DTYPES, SCALE_BYTES  # noqa: F401 (their home)


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` floats -> ``[..., D + 2]`` int8 rows: the values, then the scale."""
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / 127).clamp_(max=65504).to(torch.float16)
    scale32 = scale.float()
    # x * (1 / scale), not x / scale: the kernels multiply by the inverse, and the two
    # round differently.
    inverse = torch.where(scale32 > 0, 1.0 / scale32, torch.zeros_like(scale32))
    values = torch.round(x * inverse).clamp_(-127, 127).to(torch.int8)
    return torch.cat([values, scale.view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., D + 2]`` int8 rows -> ``[..., D]`` in dtype (computed in float32)."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float16).float()
    return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    quantized: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed (K, V) pair of ``[num_blocks, block_size, num_kv_heads, head_dim]`` per
    layer, in dtype; `quantized`: int8 rows of head_dim + 2 (see the module docstring)."""
    if quantized:
        dtype, head_dim = torch.int8, head_dim + SCALE_BYTES
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (_zeroed(shape, dtype, device), _zeroed(shape, dtype, device)) for _ in range(num_layers)
    ]


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor; on CPU one that takes RAM only where it is written.

    Zeroed rather than empty: padded gathers read unused slots, and NaN garbage there
    would survive a -inf mask as NaN * 0 in the value product. On CPU the zeros come
    from a fresh anonymous mapping, whose pages the OS hands out zero-filled on first
    touch: a 2 GiB cache costs resident memory only for the blocks requests have used
    (read or written; torch.zeros would write, and so map, every page at start-up).
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor keeps the mapping alive; it is unmapped when the tensor is freed.
    pages = mmap.mmap(-1, numel * dtype.itemsize)
    return torch.frombuffer(pages, dtype=dtype).view(shape)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the step's new keys/values ``[T, num_kv_heads, head_dim]`` at their flat slots."""
    num_kv_heads, row = k_cache.shape[-2:]
    if is_quantized(k_cache):
        k, v = quantize_kv(k), quantize_kv(v)
    k_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_request_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """The first ``seq_len`` cached entries of one request, ``[seq_len, kvh, d]`` in dtype
    (a copy; an int8 cache's rows dequantized)."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table_row[:num_blocks]).flatten(0, 1)[:seq_len]
    return dequantize_kv(blocks, dtype) if is_quantized(cache) else blocks.to(dtype)
