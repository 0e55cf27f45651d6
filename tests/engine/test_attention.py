"""Paged attention: metadata builder, write_kv, the reference backend and the fast one."""

from __future__ import annotations

import random

import pytest
import torch

import engine.attention.decode_plan as decode_plan
import engine.attention.sdpa as sdpa
from engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    CascadeGroup,
    ReferenceBackend,
    SdpaBackend,
    allocate_kv_cache,
    cascade_groups,
    get_attention_backend,
    reference_paged_attention,
    write_kv,
)
from engine.attention.cpu_paged import CpuPagedBackend
from engine.config import EngineConfig
from engine.execution_plan import ModelShape, resolve_attention
from engine.kernels import cpu_kernels, cpu_kernels_supported, ggml_kernels

BLOCK_SIZE = 4


def attend(backend: AttentionBackend, q, k_cache, v_cache, meta, scale) -> torch.Tensor:
    """One layer of a step as the model runner drives it: prepare the step, then call."""
    backend.prepare(meta)
    return backend(q, k_cache, v_cache, meta, scale)


def named(name: str, q: torch.Tensor, k_cache: torch.Tensor) -> AttentionBackend:
    """Backend ``name`` for the head layout of ``q`` and the cache; "auto": what the execution
    plan picks for q's dtype and device."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if name == "auto":
        shape = ModelShape(num_heads, num_kv_heads, q.shape[2], silu=True)
        name = resolve_attention(EngineConfig(), q.device, q.dtype, None, shape)
    return get_attention_backend(name, num_heads, num_kv_heads)


def sdpa_backend(q: torch.Tensor, k_cache: torch.Tensor, **options) -> SdpaBackend:
    return SdpaBackend(q.shape[1], k_cache.shape[2], **options)


def make_batch(
    rng: random.Random,
    shapes: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = BLOCK_SIZE,
    share: list[tuple[str, int] | None] | None = None,
):
    """A step over requests given as (query_len, seq_len), with shuffled physical blocks.

    ``share[r] = (name, n)`` makes request r's first n blocks the first n physical
    blocks (and K/V) of prefix ``name``, as prefix caching does; None = all its own.
    Returns q, the caches (already holding every request's full context), the
    metadata and each request's contiguous K/V (``[S, kvh, d]``) for dense checks.
    """
    share = share or [None] * len(shapes)
    prefix_blocks: dict[str, int] = {}
    for entry in share:
        if entry is not None:
            prefix_blocks[entry[0]] = max(prefix_blocks.get(entry[0], 0), entry[1])
    own_blocks = [
        (s + block_size - 1) // block_size - (entry[1] if entry else 0)
        for (_, s), entry in zip(shapes, share, strict=True)
    ]
    num_blocks = sum(own_blocks) + sum(prefix_blocks.values()) + 3  # a few never-used blocks
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    prefixes = {}
    for name, n in prefix_blocks.items():
        kv = torch.randn(2, n * block_size, num_kv_heads, head_dim).to(dtype)
        prefixes[name] = (physical[:n], kv)
        physical = physical[n:]
    tables, dense_kv = [], []
    for n, (_, seq_len), entry in zip(own_blocks, shapes, share, strict=True):
        k = torch.randn(seq_len, num_kv_heads, head_dim).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim).to(dtype)
        table = physical[:n]
        physical = physical[n:]
        if entry is not None:
            blocks, kv = prefixes[entry[0]]
            table = blocks[: entry[1]] + table
            k[: entry[1] * block_size] = kv[0, : entry[1] * block_size]
            v[: entry[1] * block_size] = kv[1, : entry[1] * block_size]
        tables.append(table)
        dense_kv.append((k, v))
    ((k_cache, v_cache),) = allocate_kv_cache(
        1, num_blocks, block_size, num_kv_heads, head_dim, dtype, "cpu"
    )
    # Cached prefixes are written token by token through the flat view (independent of
    # write_kv); the step's new tokens go in through write_kv like the model does.
    new_k, new_v = [], []
    for (q_len, seq_len), table, (k, v) in zip(shapes, tables, dense_kv, strict=True):
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
    fast = attend(named("auto", q, k_cache), q, k_cache, v_cache, meta, scale)
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
    fast = attend(named("sdpa", q, k_cache), q, k_cache, v_cache, meta, 0.3)
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
    fast = attend(sdpa_backend(q, k_cache, decode_group=group), q, k_cache, v_cache, meta, 0.4)
    ref = reference_paged_attention(q, k_cache, v_cache, meta, 0.4)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("decodes_first", [True, False])
def test_backend_without_cascade_equals_reference(decodes_first):
    rng = random.Random(11)
    torch.manual_seed(11)
    shapes, share, _ = sharing_step()
    order = sorted(range(len(shapes)), key=lambda r: shapes[r][0] != 1 if decodes_first else 0)
    q, k_cache, v_cache, meta, _ = make_batch(
        rng, [shapes[r] for r in order], 6, 2, 8, torch.float32, share=[share[r] for r in order]
    )
    fast = attend(named("sdpa-nocascade", q, k_cache), q, k_cache, v_cache, meta, 0.3)
    ref = reference_paged_attention(q, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


needs_cpu_kernels = pytest.mark.skipif(
    not cpu_kernels_supported(), reason="the cpu-paged backend needs AVX512-BF16"
)


@needs_cpu_kernels
def test_auto_is_cpu_paged_for_bf16_on_this_cpu_and_sdpa_otherwise():
    cpu, auto, paged = (
        torch.device("cpu"),
        EngineConfig(),
        EngineConfig(attention_backend="cpu-paged"),
    )
    wide, narrow = ModelShape(4, 2, 64, silu=True), ModelShape(4, 2, 8, silu=True)
    assert resolve_attention(auto, cpu, torch.bfloat16, None, wide) == "cpu-paged"
    assert resolve_attention(auto, cpu, torch.float32, None, wide) == "sdpa"
    assert resolve_attention(auto, cpu, torch.bfloat16, None, narrow) == "sdpa"
    with pytest.raises(ValueError, match="'cpu-paged' needs device cpu, dtype bfloat16"):
        resolve_attention(paged, cpu, torch.float32, None, wide)
    with pytest.raises(ValueError, match="head_dim 8"):
        resolve_attention(paged, cpu, torch.bfloat16, None, narrow)
    assert isinstance(get_attention_backend("cpu-paged", 4, 2), CpuPagedBackend)


@needs_cpu_kernels
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(6, 2, 16), (6, 1, 64), (4, 4, 32)]
)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("decodes_first", [True, False])
def test_cpu_paged_equals_reference_over_long_and_mixed_steps(
    num_heads, num_kv_heads, head_dim, seed, decodes_first
):
    """Decodes of up to 700 tokens (several 256-token chunks merged) among prefills."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    shapes = random_shapes(rng, 5) + [(1, rng.randint(1, 700)) for _ in range(5)] + [(1, 257)]
    if decodes_first:
        shapes.sort(key=lambda s: s[0] != 1)
    else:
        rng.shuffle(shapes)
    q, k_cache, v_cache, meta, _ = make_batch(
        rng, shapes, num_heads, num_kv_heads, head_dim, torch.bfloat16
    )
    scale = head_dim**-0.5
    out = attend(named("cpu-paged", q, k_cache), q, k_cache, v_cache, meta, scale)
    ref = reference_paged_attention(q, k_cache, v_cache, meta, scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@needs_cpu_kernels
def test_cpu_paged_decode_only_step_over_shared_prefixes_equals_reference():
    rng = random.Random(5)
    torch.manual_seed(5)
    shapes, share, _ = sharing_step()
    keep = [r for r, s in enumerate(shapes) if s[0] == 1]
    q, k_cache, v_cache, meta, _ = make_batch(
        rng, [shapes[r] for r in keep], 6, 2, 16, torch.bfloat16, share=[share[r] for r in keep]
    )
    out = attend(named("cpu-paged", q, k_cache), q, k_cache, v_cache, meta, 0.25)
    ref = reference_paged_attention(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(ggml_kernels() is None, reason="the float32 kernels need AVX2")
def test_paged_decode_kernel_rejects_what_it_cannot_attend():
    """The argument checks every build has (the float32 kernel: AVX2 and AVX-512 builds)."""
    kernel = ggml_kernels()
    q = torch.zeros(1, 4, 16, dtype=torch.float32)
    cache = torch.zeros(2, 4, 2, 16, dtype=torch.float32)
    tables, lens = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    narrow_q, narrow_cache = torch.zeros(1, 4, 12), torch.zeros(2, 4, 2, 12)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 8"):
        kernel.paged_decode_attention(narrow_q, narrow_cache, narrow_cache, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="the caches must have q's dtype, or be int8 rows"):
        kernel.paged_decode_attention(q, cache.bfloat16(), cache.bfloat16(), tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="seq_len out of range"):
        kernel.paged_decode_attention(q, cache, cache, tables, lens * 9, 1.0)
    assert kernel.paged_decode_attention(q, cache, cache, tables, lens, 1.0).shape == q.shape


@needs_cpu_kernels
def test_bf16_paged_decode_kernel_rejects_what_it_cannot_attend():
    kernel = cpu_kernels()
    q = torch.zeros(1, 4, 24, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 2, 24, dtype=torch.bfloat16)
    tables, lens = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel.paged_decode_attention(q, cache, cache, tables, lens, 1.0)
    # float32 caches beside a bf16 q: the dtype check, not the head_dim one, answers
    q, cache = torch.zeros(1, 4, 16, dtype=torch.bfloat16), torch.zeros(2, 4, 2, 16)
    with pytest.raises(RuntimeError, match="the caches must have q's dtype, or be int8 rows"):
        kernel.paged_decode_attention(q, cache, cache, tables, lens, 1.0)


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_attention_backend("nope", 4, 2)
    assert isinstance(get_attention_backend("reference", 4, 2), ReferenceBackend)
    assert get_attention_backend("sdpa", 4, 2) is not get_attention_backend("sdpa", 4, 2)
    with pytest.raises(ValueError, match="unknown attention backend 'auto'"):  # the plan's job
        get_attention_backend("auto", 4, 2)


def test_a_backend_called_before_prepare_says_so():
    q, k_cache, v_cache, meta, _ = make_batch(random.Random(0), [(1, 5)], 4, 2, 8, torch.float32)
    with pytest.raises(RuntimeError, match="prepare"):
        named("auto", q, k_cache)(q, k_cache, v_cache, meta, 0.3)


# --------------------------------------------------------------------------- cascade


def sharing_step():
    """Decodes in several prefix-sharing groups, mixed with prefills and lone decodes.

    Returns shapes, the share spec for make_batch and the cascade groups expected
    (BLOCK_SIZE 4: a decode may share whole blocks strictly before its last token).
    """
    rows = [
        ((1, 21), ("a", 5)),  # seq_len = shared tokens + 1
        ((6, 30), None),  # a prefill
        ((1, 33), ("a", 5)),
        ((1, 14), ("b", 3)),  # the prefix covers all but the last, partial block
        ((1, 25), None),  # a decode sharing nothing
        ((1, 27), ("a", 5)),
        ((1, 23), ("b", 3)),
        ((5, 25), ("a", 5)),  # a prefill on the shared prefix: not part of the cascade
        ((1, 40), ("c", 2)),  # alone with its prefix: a plain decode
        ((1, 13), ("b", 3)),
        ((1, 12), ("d", 3)),  # its last token is in the third block: shares only 2
        ((1, 20), ("d", 3)),
        ((1, 29), ("a", 5)),
    ]
    expected = {
        CascadeGroup((0, 2, 5, 12), 5),
        CascadeGroup((3, 6, 9), 3),
        CascadeGroup((10, 11), 2),
    }
    return [shape for shape, _ in rows], [entry for _, entry in rows], expected


class PrefixSpy:
    """Records what the cascade's prefix pass attends (proves the cascade path ran)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[int, int, int]] = []  # (groups, members, prefix keys)
        original = sdpa._attend_prefix_batch

        def spy(q, k_cache, v_cache, batch, scale):
            self.calls.append((batch.num_groups, batch.max_members, batch.prefix_len))
            return original(q, k_cache, v_cache, batch, scale)

        monkeypatch.setattr(sdpa, "_attend_prefix_batch", spy)


def test_cascade_groups_of_a_mixed_step():
    shapes, share, expected = sharing_step()
    _, _, _, meta, _ = make_batch(random.Random(0), shapes, 4, 2, 8, torch.float32, share=share)
    groups = cascade_groups(meta)
    assert set(groups) == expected and len(groups) == len(expected)


def tables_meta(tables: list[list[int]], seq_lens: list[int], query_lens=None):
    query_lens = query_lens or [1] * len(tables)
    return AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE, "cpu")


def test_cascade_prefers_deep_groups_over_one_shallow_one():
    """All four share block 0, pairs share 7 blocks: two pairs save more than one group of 4."""
    tables = [
        [0, 1, 2, 3, 4, 5, 6, 70],
        [0, 1, 2, 3, 4, 5, 6, 71],
        [0, 9, 10, 11, 12, 13, 14, 72],
        [0, 9, 10, 11, 12, 13, 14, 73],
    ]
    groups = cascade_groups(tables_meta([tables[i] for i in (2, 0, 3, 1)], [30] * 4))
    assert set(groups) == {CascadeGroup((0, 2), 7), CascadeGroup((1, 3), 7)}


def test_cascade_keeps_a_wide_group_over_a_deeper_pair():
    """Eight share 2 blocks and two of them a third: one group of 8 saves more (7*2 > 1*3)."""
    tables = [[0, 1, 20 + i, 40 + i] for i in range(8)]
    tables[5][2] = tables[6][2] = 99
    assert cascade_groups(tables_meta(tables, [15] * 8)) == [CascadeGroup(tuple(range(8)), 2)]


def test_cascade_groups_only_decodes_with_a_shared_whole_block():
    tables = [[0, 1, 2], [0, 1, 3], [5, 1, 2], [7], [7], [0, 1, 2]]
    seq_lens = [10, 9, 10, 3, 4, 12]
    query_lens = [1, 1, 1, 1, 1, 3]
    # Request 2 matches later blocks only; 3 and 4 have no block before their last
    # token; 5 is a prefill.
    groups = cascade_groups(tables_meta(tables, seq_lens, query_lens))
    assert groups == [CascadeGroup((0, 1), 2)]


CASCADE_DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


@pytest.mark.parametrize(("dtype", "tol"), CASCADE_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("group", [None, 1, 3])
def test_cascade_equals_reference(monkeypatch, dtype, tol, num_heads, num_kv_heads, group):
    """(6, 1): 6 query rows per KV head need two extra key blocks for their pseudo keys."""
    rng = random.Random(num_heads * 10 + num_kv_heads)
    torch.manual_seed(num_kv_heads)
    shapes, share, expected = sharing_step()
    q, k_cache, v_cache, meta, _ = make_batch(
        rng, shapes, num_heads, num_kv_heads, 8, dtype, share=share
    )
    spy = PrefixSpy(monkeypatch)
    fast = attend(sdpa_backend(q, k_cache, decode_group=group), q, k_cache, v_cache, meta, 0.3)
    # Groups a (4 members, 5 blocks) and b (3, 3) padded into one prefix batch, d apart.
    assert spy.calls == [(2, 4, 5 * BLOCK_SIZE), (1, 2, 2 * BLOCK_SIZE)]
    ref = reference_paged_attention(q, k_cache, v_cache, meta, 0.3)
    assert fast.dtype == dtype
    torch.testing.assert_close(fast.float(), ref.float(), atol=tol, rtol=tol)


def test_cascade_prefix_batches_split_when_padding_would_dominate(monkeypatch):
    """8 members x 10 blocks and 2 x 1 block: padding the small group costs too much."""
    rng = random.Random(3)
    torch.manual_seed(3)
    shapes = [(1, 41 + i) for i in range(8)] + [(1, 6), (1, 7)]
    share = [("big", 10)] * 8 + [("small", 1)] * 2
    q, k_cache, v_cache, meta, _ = make_batch(rng, shapes, 4, 2, 8, torch.float32, share=share)
    spy = PrefixSpy(monkeypatch)
    fast = attend(named("auto", q, k_cache), q, k_cache, v_cache, meta, 0.5)
    assert sorted(spy.calls) == [(1, 2, 1 * BLOCK_SIZE), (1, 8, 10 * BLOCK_SIZE)]
    ref = reference_paged_attention(q, k_cache, v_cache, meta, 0.5)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


def test_cascade_and_plain_groups_under_a_small_key_budget(monkeypatch):
    """The CPU default packs decodes by padded keys; a tiny budget makes many groups."""
    monkeypatch.setattr(decode_plan, "CPU_DECODE_KEYS", 24)
    rng = random.Random(5)
    torch.manual_seed(5)
    shapes, share, _ = sharing_step()
    q, k_cache, v_cache, meta, _ = make_batch(rng, shapes, 6, 2, 8, torch.float32, share=share)
    fast = attend(sdpa_backend(q, k_cache), q, k_cache, v_cache, meta, 0.3)
    ref = reference_paged_attention(q, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


def test_cascade_layers_reuse_the_step_plan(monkeypatch):
    """One prepare plans the step; each layer's prefix results replace the last's."""
    rng = random.Random(8)
    torch.manual_seed(8)
    shapes, share, _ = sharing_step()
    q, k1, v1, meta, _ = make_batch(rng, shapes, 6, 2, 8, torch.float32, share=share)
    _, k2, v2, _, _ = make_batch(random.Random(8), shapes, 6, 2, 8, torch.float32, share=share)
    k2.normal_()  # a second layer: same blocks, other contents
    v2.normal_()
    plans = []
    plan_decodes = sdpa.plan_decodes
    monkeypatch.setattr(sdpa, "plan_decodes", lambda *a: plans.append(a) or plan_decodes(*a))
    backend = named("auto", q, k1)
    backend.prepare(meta)
    for k_cache, v_cache in [(k1, v1), (k2, v2), (k1, v1)]:
        fast = backend(q, k_cache, v_cache, meta, 0.3)
        ref = reference_paged_attention(q, k_cache, v_cache, meta, 0.3)
        torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    assert len(plans) == 1  # the layers only ran the plan


def random_sharing_step(rng: random.Random):
    """Random prefixes shared by random decodes with random own lengths, plus other requests."""
    shapes, share = [], []
    for p in range(rng.randint(1, 4)):
        blocks = rng.randint(1, 8)
        for _ in range(rng.randint(1, 5)):
            # Up to all its blocks of the prefix, then at least one token of its own.
            n = rng.randint(1, blocks)
            shapes.append((1, n * BLOCK_SIZE + rng.randint(1, 3 * BLOCK_SIZE)))
            share.append((f"p{p}", n))
    for shape in random_shapes(rng, rng.randint(0, 4)):
        shapes.append(shape)
        share.append(None)
    order = list(range(len(shapes)))
    rng.shuffle(order)
    return [shapes[i] for i in order], [share[i] for i in order]


@pytest.mark.parametrize(("dtype", "tol"), CASCADE_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("seed", range(12))
def test_cascade_random_sharing_equals_reference(dtype, tol, seed):
    rng = random.Random(100 + seed)
    torch.manual_seed(seed)
    shapes, share = random_sharing_step(rng)
    q, k_cache, v_cache, meta, _ = make_batch(rng, shapes, 6, 2, 8, dtype, share=share)
    fast = attend(named("auto", q, k_cache), q, k_cache, v_cache, meta, 0.35)
    ref = reference_paged_attention(q, k_cache, v_cache, meta, 0.35)
    torch.testing.assert_close(fast.float(), ref.float(), atol=tol, rtol=tol)


def test_gather_workspace_serves_inference_mode_and_normal_callers():
    """The engine gathers under inference mode; tests and tools may call outside it.
    A buffer created in one mode must never be written in the other (RuntimeError)."""
    from engine.attention.sdpa import _workspace

    like = torch.zeros(1)
    with torch.inference_mode():
        k, _ = _workspace.get((4,), like)
        k.fill_(1.0)
    k, _ = _workspace.get((4,), like)
    k.fill_(2.0)
    with torch.inference_mode():
        k, _ = _workspace.get((4,), like)
        k.fill_(3.0)


@pytest.mark.parametrize("masked", [False, True])
def test_attention_with_lse_fused_equals_plain_ops(masked):
    # The CPU path uses torch's fused kernel; other devices the plain ops: both must agree
    # on the output and on the log-sum-exp the cascade merges with.
    from engine.attention import attention_with_lse, attention_with_lse_ops

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 3, 6, 64, generator=gen)
    k = torch.randn(4, 40, 3, 64, generator=gen).transpose(1, 2)  # strided, as gathered
    v = torch.randn(4, 40, 3, 64, generator=gen).transpose(1, 2)
    mask = None
    if masked:
        mask = torch.zeros(4, 1, 1, 40)
        mask[1, ..., 25:] = float("-inf")
    out, lse = attention_with_lse(q, k, v, mask, 0.125)
    ref_out, ref_lse = attention_with_lse_ops(q, k, v, mask, 0.125)
    scores = (q @ k.transpose(-1, -2)) * 0.125 + (0 if mask is None else mask)
    torch.testing.assert_close(lse, scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def _rss_mib() -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) // 1024


def test_cpu_kv_cache_is_zero_and_takes_memory_only_where_written():
    before = _rss_mib()
    caches = allocate_kv_cache(4, 4096, 16, 2, 64, torch.float32, "cpu")
    assert sum(k.nbytes + v.nbytes for k, v in caches) == 256 * 2**20
    k, v = caches[0]
    assert _rss_mib() - before < 32
    # Zeros where read (a read maps the pages it touches, so only a few blocks here).
    assert not k[:8].any() and not v[-8:].any() and not caches[-1][0][2048:2056].any()
    k[:1024] = 1.0  # a quarter of one layer's K: 8 MiB resident
    assert k[:1024].all() and not k[1024:].any()
    assert _rss_mib() - before < 48
    for k, v in caches:
        k.fill_(2.0)
        v.fill_(2.0)
    assert _rss_mib() - before >= 240  # every page written: now it all counts
