"""The paged KV cache tensors: allocated once, written each layer, gathered per request.

Per layer the cache is a K and a V tensor of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; a token's flat slot is
``block_id * block_size + offset`` (see `AttentionMetadata.slot_mapping`).
"""

from __future__ import annotations

import math
import mmap

import torch


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed (K, V) pair of ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer."""
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
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_request_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first ``seq_len`` cached entries of one request, ``[seq_len, kvh, d]`` (a copy)."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table_row[:num_blocks])
    return blocks.flatten(0, 1)[:seq_len]
