"""The steps bench/attention_bench.py times: SmolLM2's attention shapes, its named
scenarios and one step's q, random K/V caches and metadata over shuffled physical blocks.
"""

from __future__ import annotations

import random

import torch

from engine.attention import AttentionMetadata, allocate_kv_cache

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# --------------------------------------------------------------------------- scenarios


SHARED_GROUPS, SHARED_PREFIX = 4, 500


def scenario(name: str) -> tuple[list[int], list[int], list[int | None]]:
    """(query_lens, seq_lens, shared prefix group of each request or None) of a named step."""
    rng = random.Random(name)
    if name == "shared-decode64":  # 4 prefixes x 16 decodes, each with 16..144 own tokens
        seq_lens = [SHARED_PREFIX + rng.randint(16, 144) for _ in range(64)]
        return [1] * 64, seq_lens, [r % SHARED_GROUPS for r in range(64)]
    if name.startswith("decode"):
        batch = int(name.removeprefix("decode"))
        return [1] * batch, [rng.randint(560, 640) for _ in range(batch)], [None] * batch
    if name == "prefill500":
        return [500], [500], [None]
    if name == "prefill500+cached500":
        return [500], [1000], [None]
    if name == "mixed":  # 32 decodes riding along with a 256-token prefill chunk on a prefix
        seq_lens = [rng.randint(560, 640) for _ in range(32)] + [768]
        return [1] * 32 + [256], seq_lens, [None] * 33
    raise ValueError(name)


SCENARIOS = [
    "decode1",
    "decode8",
    "decode32",
    "decode64",
    "shared-decode64",
    "prefill500",
    "prefill500+cached500",
    "mixed",
]


def build_step(query_lens, seq_lens, dtype, seed=0, share=None):
    """q, caches filled with random K/V, and the metadata, over shuffled physical blocks.

    Requests with the same ``share`` group start with the same physical blocks: the
    full blocks of a SHARED_PREFIX-token prefix, as prefix caching hands them out.
    """
    rng = random.Random(seed)
    share = share or [None] * len(seq_lens)
    shared_blocks = SHARED_PREFIX // BLOCK_SIZE
    needed = [
        (s + BLOCK_SIZE - 1) // BLOCK_SIZE - (shared_blocks if g is not None else 0)
        for s, g in zip(seq_lens, share, strict=True)
    ]
    groups = sorted({g for g in share if g is not None})
    num_blocks = sum(needed) + shared_blocks * len(groups) + 16
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    prefix = {}
    for g in groups:
        prefix[g], physical = physical[:shared_blocks], physical[shared_blocks:]
    tables = []
    for n, g in zip(needed, share, strict=True):
        tables.append((prefix[g] if g is not None else []) + physical[:n])
        physical = physical[n:]
    ((k_cache, v_cache),) = allocate_kv_cache(
        1, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype, "cpu"
    )
    k_cache.normal_()
    v_cache.normal_()
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE, "cpu")
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM).to(dtype)
    return q, k_cache, v_cache, meta, tables
