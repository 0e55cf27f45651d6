"""Sliding-window attention: every backend that takes a window equals the reference, which
equals a dense band mask (transformers' sliding mask: key k is seen by query q when
0 <= q - k < window)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import get_attention_backend
from engine.attention.reference import reference_paged_attention
from engine.kernels import cpu_kernels, ggml_kernels
from tests.engine.test_attention import attend, make_batch, random_shapes

# Kernel rows (<= 64 tokens), long prefills over a cached prefix, and decodes of up to 700
# tokens (several of the kernel's 256-key chunks) against windows smaller and larger than
# the context.
WINDOWS = [1, 5, 33, 300, 10_000]


def banded_dense(q, dense_kv, meta, scale, window):
    """Per request: softmax over its keys with the band mask, from the dense K/V."""
    outs = []
    for r, (k, v) in enumerate(dense_kv):
        start, end = meta.query_start_loc_list[r], meta.query_start_loc_list[r + 1]
        seq_len, q_len = meta.seq_lens_list[r], end - start
        group = q.shape[1] // k.shape[1]
        kf = k.float().repeat_interleave(group, dim=1)
        vf = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,shd->hls", q[start:end].float(), kf) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        seen = (k_pos <= q_pos) & (q_pos - k_pos < window)
        scores = scores.masked_fill(~seen, float("-inf"))
        outs.append(torch.einsum("hls,shd->lhd", scores.softmax(-1), vf))
    return torch.cat(outs)


def windowed_step(seed: int, dtype: torch.dtype):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    shapes = random_shapes(rng, 4) + [(1, rng.randint(1, 700)) for _ in range(4)]
    shapes += [(100, 400), (80, 80), (1, 257)]  # long prefills: one over a cached prefix
    rng.shuffle(shapes)
    return make_batch(rng, shapes, 6, 2, 16, dtype)


@pytest.mark.parametrize("window", WINDOWS)
def test_reference_window_equals_a_dense_band_mask(window):
    q, k_cache, v_cache, meta, dense_kv = windowed_step(0, torch.float32)
    out = reference_paged_attention(q, k_cache, v_cache, meta, 0.25, window)
    torch.testing.assert_close(out, banded_dense(q, dense_kv, meta, 0.25, window))


BACKENDS = ["sdpa", "sdpa-nocascade", "reference"]
if ggml_kernels() is not None:
    BACKENDS.append("cpu-paged")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("seed", range(2))
def test_backend_window_equals_reference(backend, window, seed):
    q, k_cache, v_cache, meta, _ = windowed_step(seed, torch.float32)
    attn = get_attention_backend(backend, q.shape[1], k_cache.shape[2], window=window)
    out = attend(attn, q, k_cache, v_cache, meta, 0.25)
    ref = reference_paged_attention(q, k_cache, v_cache, meta, 0.25, window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_a_window_changes_the_output():
    """The test above would pass with the window ignored only if no query reached past it."""
    q, k_cache, v_cache, meta, _ = windowed_step(0, torch.float32)
    full = reference_paged_attention(q, k_cache, v_cache, meta, 0.25)
    banded = reference_paged_attention(q, k_cache, v_cache, meta, 0.25, 33)
    assert not torch.allclose(full, banded)


def test_a_backend_without_windows_is_refused_for_a_windowed_group(monkeypatch):
    """Every backend takes a window today; one that did not would be refused by name."""
    from engine.attention.sdpa import SdpaBackend

    monkeypatch.setattr(SdpaBackend, "sliding_windows", False)
    with pytest.raises(ValueError, match="no sliding window"):
        get_attention_backend("sdpa", 4, 2, window=16)
    get_attention_backend("sdpa", 4, 2)  # full attention still served


@pytest.mark.skipif(ggml_kernels() is None, reason="the paged decode kernel needs AVX2")
@pytest.mark.parametrize("window", WINDOWS)
def test_cpu_paged_window_in_the_models_dtype(window):
    """bf16 where the AVX-512 kernels run (the bf16 kernel), float32 elsewhere."""
    dtype = torch.bfloat16 if cpu_kernels() is not None else torch.float32
    q, k_cache, v_cache, meta, _ = windowed_step(1, dtype)
    attn = get_attention_backend("cpu-paged", q.shape[1], k_cache.shape[2], window=window)
    out = attend(attn, q, k_cache, v_cache, meta, 0.25)
    ref = reference_paged_attention(q, k_cache, v_cache, meta, 0.25, window)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
