"""Paged attention: metadata builder, write_kv, the reference backend and the fast one."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import (
    AttentionMetadata,
    allocate_kv_cache,
    get_attention_backend,
    make_sdpa_backend,
    reference_paged_attention,
    write_kv,
)

BLOCK_SIZE = 4


def make_batch(
    rng: random.Random,
    shapes: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = BLOCK_SIZE,
):
    """A step over requests given as (query_len, seq_len), with shuffled physical blocks.

    Returns q, the caches (already holding every request's full context), the
    metadata and each request's contiguous K/V (``[S, kvh, d]``) for dense checks.
    """
    blocks_needed = [(s + block_size - 1) // block_size for _, s in shapes]
    num_blocks = sum(blocks_needed) + 3  # a few never-used blocks
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    tables, dense_kv = [], []
    for n in blocks_needed:
        tables.append(physical[:n])
        physical = physical[n:]
    ((k_cache, v_cache),) = allocate_kv_cache(
        1, num_blocks, block_size, num_kv_heads, head_dim, dtype, "cpu"
    )
    # Cached prefixes are written token by token through the flat view (independent of
    # write_kv); the step's new tokens go in through write_kv like the model does.
    new_k, new_v = [], []
    for (q_len, seq_len), table in zip(shapes, tables, strict=True):
        k = torch.randn(seq_len, num_kv_heads, head_dim).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim).to(dtype)
        dense_kv.append((k, v))
        for pos in range(seq_len - q_len):
            slot = table[pos // block_size] * block_size + pos % block_size
            k_cache.view(-1, num_kv_heads, head_dim)[slot] = k[pos]
            v_cache.view(-1, num_kv_heads, head_dim)[slot] = v[pos]
        new_k.append(k[seq_len - q_len :])
        new_v.append(v[seq_len - q_len :])
    meta = AttentionMetadata.build(
        [q for q, _ in shapes], [s for _, s in shapes], tables, block_size, "cpu"
    )
    write_kv(k_cache, v_cache, torch.cat(new_k), torch.cat(new_v), meta.slot_mapping)
    q = torch.randn(meta.num_tokens, num_heads, head_dim).to(dtype)
    return q, k_cache, v_cache, meta, dense_kv


def dense_causal_attention(q, k, v, scale):
    """Textbook attention on contiguous tensors: q [L, h, d] = the last L positions of k/v [S, kvh, d]."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    out = torch.empty(q_len, num_heads, q.shape[2], dtype=torch.float64)
    for h in range(num_heads):
        kh = k[:, h * num_kv_heads // num_heads].double()
        vh = v[:, h * num_kv_heads // num_heads].double()
        for i in range(q_len):
            pos = seq_len - q_len + i
            scores = (kh[: pos + 1] @ q[i, h].double()) * scale
            weights = torch.softmax(scores, dim=0)
            out[i, h] = weights @ vh[: pos + 1]
    return out


def random_shapes(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """Mixed requests: decodes, fresh prefills, prefills on a cached prefix, chunks."""
    shapes = []
    for _ in range(n):
        kind = rng.choice(["decode", "fresh", "prefix", "chunk"])
        if kind == "decode":
            shapes.append((1, rng.randint(1, 40)))
        elif kind == "fresh":
            q_len = rng.randint(2, 30)
            shapes.append((q_len, q_len))
        elif kind == "prefix":  # cached prefix is whole blocks
            q_len = rng.randint(2, 20)
            shapes.append((q_len, q_len + BLOCK_SIZE * rng.randint(1, 5)))
        else:  # a chunk continuing a partially computed prompt (any offset)
            q_len = rng.randint(2, 20)
            shapes.append((q_len, q_len + rng.randint(1, 25)))
    return shapes


def test_build_matches_per_token_lookup():
    query_lens, seq_lens = [1, 5, 3, 1], [9, 5, 11, 4]
    tables = [[7, 2, 9], [4, 0], [1, 3, 8], [6]]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE, "cpu")
    slots, positions = [], []
    for q_len, seq_len, table in zip(query_lens, seq_lens, tables, strict=True):
        for pos in range(seq_len - q_len, seq_len):
            positions.append(pos)
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    assert meta.slot_mapping.tolist() == slots
    assert meta.positions.tolist() == positions
    assert meta.query_start_loc.tolist() == [0, 1, 6, 9, 10]
    assert meta.seq_lens.tolist() == seq_lens
    assert meta.block_tables.tolist() == [[7, 2, 9], [4, 0, 0], [1, 3, 8], [6, 0, 0]]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_decodes) == (5, 11, 2)
    assert meta.slot_mapping.dtype == torch.int64 and meta.positions.dtype == torch.int64
    assert meta.query_start_loc.dtype == meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.dtype == torch.int32


def test_build_rejects_short_block_table():
    with pytest.raises(ValueError, match="block table"):
        AttentionMetadata.build([1], [9], [[0, 1]], BLOCK_SIZE, "cpu")


def test_write_kv_puts_values_at_their_slots():
    ((k_cache, v_cache),) = allocate_kv_cache(1, 6, BLOCK_SIZE, 2, 8, torch.float32, "cpu")
    slots = torch.tensor([17, 3, 22, 8])
    k = torch.randn(4, 2, 8)
    v = torch.randn(4, 2, 8)
    write_kv(k_cache, v_cache, k, v, slots)
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, BLOCK_SIZE)
        assert torch.equal(k_cache[block, offset], k[i])
        assert torch.equal(v_cache[block, offset], v[i])
    untouched = torch.ones(6 * BLOCK_SIZE, dtype=torch.bool)
    untouched[slots] = False
    assert k_cache.view(-1, 2, 8)[untouched].abs().sum() == 0
    assert v_cache.view(-1, 2, 8)[untouched].abs().sum() == 0


@pytest.mark.parametrize("seed", range(3))
def test_reference_equals_dense_causal_attention(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    q, k_cache, v_cache, meta, dense_kv = make_batch(
        rng, random_shapes(rng, 6), 4, 2, 8, torch.float32
    )
    scale = 8**-0.5
    out = reference_paged_attention(q, k_cache, v_cache, meta, scale)
    starts = meta.query_start_loc_list
    for r, (k, v) in enumerate(dense_kv):
        expected = dense_causal_attention(q[starts[r] : starts[r + 1]], k, v, scale)
        torch.testing.assert_close(
            out[starts[r] : starts[r + 1]].double(), expected, atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("decodes_first", [True, False])
def test_fast_backend_equals_reference(dtype, tol, seed, decodes_first):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    shapes = random_shapes(rng, 8) + [(1, rng.randint(1, 40)) for _ in range(3)]
    if decodes_first:
        shapes.sort(key=lambda s: s[0] != 1)
    else:
        rng.shuffle(shapes)
    q, k_cache, v_cache, meta, _ = make_batch(rng, shapes, 6, 2, 16, dtype)
    scale = 16**-0.5
    fast = get_attention_backend("auto")(q, k_cache, v_cache, meta, scale)
    ref = reference_paged_attention(q, k_cache, v_cache, meta, scale)
    assert fast.dtype == dtype and fast.shape == q.shape
    torch.testing.assert_close(fast.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_backend_decodes_without_padding(dtype):
    """All decodes end on a block boundary: the batched path runs with no key mask."""
    rng = random.Random(7)
    torch.manual_seed(7)
    shapes = [(1, 3 * BLOCK_SIZE)] * 4 + [(5, 9)]
    q, k_cache, v_cache, meta, _ = make_batch(rng, shapes, 4, 1, 8, dtype)
    fast = get_attention_backend("sdpa")(q, k_cache, v_cache, meta, 0.3)
    ref = reference_paged_attention(q, k_cache, v_cache, meta, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("group", [1, 3, 1000])
def test_fast_backend_any_decode_grouping_equals_reference(group):
    """Decodes split into groups of any size (CPU default is small, GPU takes them all)."""
    rng = random.Random(group)
    torch.manual_seed(group)
    shapes = [(1, rng.randint(1, 40)) for _ in range(7)] + [(6, 20)]
    rng.shuffle(shapes)
    q, k_cache, v_cache, meta, _ = make_batch(rng, shapes, 6, 3, 8, torch.float32)
    fast = make_sdpa_backend(group)(q, k_cache, v_cache, meta, 0.4)
    ref = reference_paged_attention(q, k_cache, v_cache, meta, 0.4)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_attention_backend("nope")
    assert get_attention_backend("reference") is reference_paged_attention
