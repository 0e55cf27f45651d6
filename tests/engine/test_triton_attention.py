"""The Triton backend's kernels (engine/attention/triton_paged.py), run on CPU tensors
through Triton's interpreter, against the reference backend: GQA, block boundaries,
prefix hits, prefill chunks, mixed steps, split-K decodes; and a model stepping through
them gives the reference backend's greedy tokens.

On `--device cuda` (marked `device`) the same tests run the compiled kernels on the GPU
against the reference on the host; tests/conftest.py sets TRITON_INTERPRET=1 otherwise.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton", reason="triton comes with torch's CUDA build and xgrammar")

import engine.attention.triton_paged as triton_paged  # noqa: E402
from engine.attention import AttentionMetadata, reference_paged_attention, write_kv  # noqa: E402
from engine.attention.triton_paged import TritonBackend, plan_step  # noqa: E402
from tests.engine.test_attention import make_batch  # noqa: E402

pytestmark = pytest.mark.device

BS = 16  # tokens per KV block (the default)


def on_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    tables = meta.block_tables_host.tolist()
    return AttentionMetadata.build(
        meta.query_lens, meta.seq_lens_list, tables, meta.block_size, device
    )


def triton_attend(q, k_cache, v_cache, meta, scale, device=None):
    """The backend's output on `device` (the tensors' own by default), back on the host."""
    device = device if device is not None else q.device
    q, k_cache, v_cache = q.to(device), k_cache.to(device), v_cache.to(device)
    meta = on_device(meta, device)
    backend = TritonBackend(q.shape[1], k_cache.shape[2])
    backend.prepare(meta)
    return backend(q, k_cache, v_cache, meta, scale).to("cpu")


def assert_equals_reference(q, k_cache, v_cache, meta, scale, device) -> None:
    """The backend's output on `device` equals the reference's on the host (float32)."""
    torch.testing.assert_close(
        triton_attend(q, k_cache, v_cache, meta, scale, device),
        reference_paged_attention(q, k_cache, v_cache, meta, scale),
        atol=1e-5, rtol=1e-5,
    )  # fmt: skip


# (query_len, seq_len) per request: decodes on and across block boundaries, a fresh
# prefill, chunks over a cached prefix (prefix hits), and steps mixing them.
STEPS = {
    "decodes": [(1, 1), (1, 16), (1, 17), (1, 40)],
    "prefill": [(37, 37)],
    "chunk over a cached prefix": [(20, 52), (5, 16)],
    "mixed": [(1, 33), (18, 18), (1, 5), (9, 41)],
}


@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (8, 1)], ids=["gqa3", "mha", "mqa"])
@pytest.mark.parametrize("step", STEPS.values(), ids=STEPS.keys())
def test_paged_attention_equals_the_reference(step, heads, device):
    q, k_cache, v_cache, meta, _ = make_batch(
        random.Random(len(step)), step, *heads, head_dim=16, dtype=torch.float32, block_size=BS
    )
    want = reference_paged_attention(q, k_cache, v_cache, meta, 0.25)
    got = triton_attend(q, k_cache, v_cache, meta, 0.25, device)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_prefix_shared_blocks_are_read_in_place(device):
    # Two requests whose first blocks are the same physical blocks (a prefix hit).
    share = [("p", 2), ("p", 2), None]
    q, k_cache, v_cache, meta, _ = make_batch(
        random.Random(3), [(1, 40), (7, 45), (1, 9)], 4, 2, 16, torch.float32, BS, share
    )
    assert_equals_reference(q, k_cache, v_cache, meta, 0.3, device)


def test_split_k_decodes_equal_the_reference(monkeypatch, device):
    monkeypatch.setattr(triton_paged, "SPLIT_KEYS", 16)  # split even these short contexts
    step = [(1, 70), (1, 3), (1, 33)]
    q, k_cache, v_cache, meta, _ = make_batch(random.Random(5), step, 6, 2, 16,
                                              torch.float32, BS)  # fmt: skip
    plan = plan_step(meta, num_kv_heads=2)
    assert plan.num_splits > 1  # the split path, with a split left empty for the short one
    assert_equals_reference(q, k_cache, v_cache, meta, 0.25, device)


def test_bf16_within_bf16_tolerance(device):
    q, k_cache, v_cache, meta, _ = make_batch(
        random.Random(7), STEPS["mixed"], 6, 2, 32, torch.bfloat16, BS
    )
    torch.testing.assert_close(
        triton_attend(q, k_cache, v_cache, meta, 0.2, device).float(),
        reference_paged_attention(q, k_cache, v_cache, meta, 0.2).float(),
        atol=2e-2, rtol=2e-2,
    )  # fmt: skip


def test_write_kv_kernel_equals_index_copy(device):
    step = [(3, 20), (1, 17)]
    _, k_cache, v_cache, meta, _ = make_batch(random.Random(9), step, 4, 2, 16,
                                              torch.float32, BS)  # fmt: skip
    k = torch.randn(meta.num_tokens, 2, 16)
    v = torch.randn(meta.num_tokens, 2, 16)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv(want_k, want_v, k, v, meta.slot_mapping)
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    triton_paged.triton_write_kv(k_cache, v_cache, k.to(device), v.to(device),
                                 meta.slot_mapping.to(device))  # fmt: skip
    assert torch.equal(k_cache.cpu(), want_k) and torch.equal(v_cache.cpu(), want_v)


@pytest.mark.parametrize("split_keys", [256, 16], ids=["whole", "split"])
def test_padded_decode_rows_read_and_write_nothing(split_keys, monkeypatch, device):
    # A CUDA graph's batch of 5 holding 3 decodes: rows 3 and 4 have context length 0
    # and slot -1 (engine/cuda_graphs.py). Their write must leave the cache as it was,
    # their output is 0 (not NaN, also when split), and the real rows are unchanged.
    monkeypatch.setattr(triton_paged, "SPLIT_KEYS", split_keys)
    step = [(1, 40), (1, 17), (1, 33), (1, 1), (1, 1)]
    q, k_cache, v_cache, meta, _ = make_batch(random.Random(13), step, 6, 2, 16,
                                              torch.float32, BS)  # fmt: skip
    want = reference_paged_attention(q, k_cache, v_cache, meta, 0.25)[:3]
    padded = on_device(meta, device)
    padded.seq_lens[3:] = 0
    padded.slot_mapping[3:] = -1
    q, k_cache, v_cache = q.to(device), k_cache.to(device), v_cache.to(device)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    backend = TritonBackend(6, 2)
    backend.prepare(padded)
    assert (backend._plan.num_splits > 1) == (split_keys == 16)
    backend.write_kv(k_cache, v_cache, torch.ones(5, 2, 16, device=device),
                     torch.ones(5, 2, 16, device=device), padded.slot_mapping)  # fmt: skip
    changed = (k_cache != before_k).any(-1).any(-1).flatten().nonzero().flatten().tolist()
    assert changed == padded.slot_mapping[:3].sort().values.tolist()  # the 3 real rows only
    assert torch.equal(v_cache != before_v, k_cache != before_k)
    k_cache.view(-1, 2, 16)[padded.slot_mapping[:3]] = before_k.view(-1, 2, 16)[
        padded.slot_mapping[:3]
    ]
    v_cache.view(-1, 2, 16)[padded.slot_mapping[:3]] = before_v.view(-1, 2, 16)[
        padded.slot_mapping[:3]
    ]
    out = backend(q, k_cache, v_cache, padded, 0.25).cpu()
    torch.testing.assert_close(out[:3], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))


@pytest.mark.parametrize("block_size", [4, 32, 128])
def test_key_tiles_span_small_blocks_and_part_of_large_ones(block_size, device):
    # A tile is 16-64 keys whatever the block size: each key finds its own block.
    for step in (STEPS["mixed"], STEPS["decodes"]):
        q, k_cache, v_cache, meta, _ = make_batch(random.Random(block_size), step, 6, 2, 16,
                                                  torch.float32, block_size)  # fmt: skip
        assert_equals_reference(q, k_cache, v_cache, meta, 0.25, device)


def test_a_model_on_the_triton_backend_gives_the_reference_tokens(tmp_path, device):
    from engine import EngineConfig, LLMEngine, SamplingParams
    from tests.engine.tiny_models import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    prompts = [[5, 6, 7] * 7, [5, 6, 7] * 7 + [9, 10], [11] * 40]  # a prefix hit, a long one
    outputs = {}
    for backend in ("reference", "triton"):
        engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device=str(device),
                                        num_blocks=64, attention_backend=backend,
                                        max_num_batched_tokens=32))  # fmt: skip
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), ids, SamplingParams(max_tokens=6, temperature=0.0))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        outputs[backend] = done
    assert outputs["triton"] == outputs["reference"]


def test_a_head_dim_below_a_tile_is_masked(device):
    # head_dim 8 runs in a 16-wide tile (tl.dot's smallest): the padding must not leak.
    q, k_cache, v_cache, meta, _ = make_batch(random.Random(11), STEPS["mixed"], 4, 2, 8,
                                              torch.float32, BS)  # fmt: skip
    assert_equals_reference(q, k_cache, v_cache, meta, 0.35, device)
