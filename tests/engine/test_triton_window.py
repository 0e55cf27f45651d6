"""The Triton backend with a sliding window (engine/attention/triton_paged.py) against the
reference's band mask: mixed steps of decodes shorter and longer than the window, split-K
decodes, prefills over a cached prefix; keys before a window are never read (their block
table entries are placeholders over a block of NaN); and a windowed decode-only step is
planned as a CUDA graph needs. Under the interpreter on CPU, compiled on `--device cuda`
(tests/engine/test_triton_attention.py)."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton", reason="triton comes with torch's CUDA build and xgrammar")

import engine.attention.triton_paged as triton_paged  # noqa: E402
from engine.attention import AttentionMetadata, reference_paged_attention  # noqa: E402
from engine.attention.triton_paged import TritonBackend, plan_step  # noqa: E402
from tests.engine.test_attention import make_batch  # noqa: E402

pytestmark = pytest.mark.device

# (query_len, seq_len): decodes shorter and longer than the windows below, on and across
# block boundaries; a fresh prefill; chunks over a cached prefix (some starting past it).
MIXED = [(1, 70), (20, 52), (1, 5), (9, 41), (1, 33), (18, 18)]


def placeholder_step(q, k_cache, v_cache, meta, window, device):
    """The step on `device` as a sliding-window group holds it: every block wholly before
    the first key any of a request's queries sees is table entry 0, and block 0 (a block
    added in front of the pool) and those blocks themselves hold NaN: reading any of them
    shows in the output."""
    bs = meta.block_size
    nan_block = torch.full_like(k_cache[:1], float("nan"))
    k_cache = torch.cat([nan_block, k_cache])
    v_cache = torch.cat([nan_block, v_cache])
    tables = []
    for r, (q_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens_list, strict=True)):
        table = [b + 1 for b in meta.block_tables_host[r, : -(-seq_len // bs)].tolist()]
        gone = max(0, seq_len - q_len - window + 1) // bs  # blocks before every query's window
        for i in range(gone):
            k_cache[table[i]] = v_cache[table[i]] = float("nan")
            table[i] = 0
        tables.append(table)
    meta = AttentionMetadata.build(meta.query_lens, meta.seq_lens_list, tables, bs, device)
    return q.to(device), k_cache.to(device), v_cache.to(device), meta


def windowed_attend(q, k_cache, v_cache, meta, window, device, scale=0.25):
    q, k_cache, v_cache, meta = placeholder_step(q, k_cache, v_cache, meta, window, device)
    backend = TritonBackend(q.shape[1], k_cache.shape[2], window)
    backend.prepare(meta)
    return backend(q, k_cache, v_cache, meta, scale).cpu(), backend._plan


@pytest.mark.parametrize("window", [1, 7, 20, 1000])
def test_mixed_steps_equal_the_reference(window, device):
    q, k_cache, v_cache, meta, _ = make_batch(random.Random(window), MIXED, 6, 2, 16,
                                              torch.float32, 16)  # fmt: skip
    want = reference_paged_attention(q, k_cache, v_cache, meta, 0.25, window)
    got, _ = windowed_attend(q, k_cache, v_cache, meta, window, device)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if window < 70:  # the window is not ignored
        assert not torch.allclose(want, reference_paged_attention(q, k_cache, v_cache, meta, 0.25))


@pytest.mark.parametrize("window", [20, 45])
def test_split_k_decodes_share_the_window(window, monkeypatch, device):
    monkeypatch.setattr(triton_paged, "SPLIT_KEYS", 16)  # split even these short contexts
    step = [(1, 90), (1, 3), (1, 45), (1, 21)]  # longer, shorter, as long as the window
    q, k_cache, v_cache, meta, _ = make_batch(random.Random(window), step, 8, 2, 16,
                                              torch.float32, 4)  # fmt: skip
    want = reference_paged_attention(q, k_cache, v_cache, meta, 0.25, window)
    got, plan = windowed_attend(q, k_cache, v_cache, meta, window, device)
    # Split over the window's keys, not the 90 of the longest context: 2 and 4 splits.
    assert plan.num_splits == triton_paged.decode_splits(4, 2, window) < 8
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_padded_windowed_decode_row_reads_nothing(device):
    # A CUDA graph's padding row: context length 0 (engine/cuda_graphs.py); its output is 0.
    q, k_cache, v_cache, meta, _ = make_batch(random.Random(2), [(1, 60), (1, 9)], 4, 2, 16,
                                              torch.float32, 16)  # fmt: skip
    want = reference_paged_attention(q, k_cache, v_cache, meta, 0.25, 10)[:1]
    q, k_cache, v_cache, padded = placeholder_step(q, k_cache, v_cache, meta, 10, device)
    padded.seq_lens[1:] = 0
    backend = TritonBackend(4, 2, 10)
    backend.prepare(padded)
    out = backend(q, k_cache, v_cache, padded, 0.25).cpu()
    torch.testing.assert_close(out[:1], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))


def test_a_windowed_decode_plan_is_host_integers_only():
    # As CUDA graphs capture it (engine/cuda_graphs.py): contexts up to max_model_len, the
    # splits from the window (a constant of the backend), no tensor made.
    meta = AttentionMetadata.build([1] * 2, [4096] * 2, [[0] * 256] * 2, 16, "cpu")
    full, windowed = plan_step(meta, 2), plan_step(meta, 2, window=256)
    assert full.num_splits == triton_paged.MAX_SPLITS and windowed.num_splits == 1
    assert all(t is meta.seq_lens for t in windowed.tiles.values())


def test_auto_is_triton_for_windowed_and_hybrid_models_on_cuda():
    from engine import EngineConfig
    from engine.execution_plan import ModelShape, graphs_off_reason, resolve_attention

    cuda = torch.device("cuda")
    for groups in (1, 2):  # every layer windowed; windowed beside full layers
        shape = ModelShape(4, 2, 16, silu=True, sliding_window=True, kv_cache_groups=groups)
        assert resolve_attention(EngineConfig(), cuda, torch.bfloat16, None, shape) == "triton"
    assert graphs_off_reason(cuda, False, "triton", 1) is None  # decode steps captured


def test_bf16_windowed_within_bf16_tolerance(device):
    q, k_cache, v_cache, meta, _ = make_batch(random.Random(4), MIXED, 6, 2, 32,
                                              torch.bfloat16, 16)  # fmt: skip
    want = reference_paged_attention(q, k_cache, v_cache, meta, 0.2, 13)
    got, _ = windowed_attend(q, k_cache, v_cache, meta, 13, device, scale=0.2)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_windowed_decodes_replayed_from_cuda_graphs_give_sdpas_tokens(tmp_path, device):
    """Gemma 3's layout: a layer of window 12 (contexts up to 32 here) beside a full one,
    two KV cache groups over one pool (kv_cache/groups.py), each with its own tables and
    slots in the graphs' buffers (the windowed group's the second, `group_metas`), and its
    tables lose their first blocks as the window moves on."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.cuda_graphs import CudaGraphRunner
    from tests.engine.test_cuda_graphs import RerunCapture
    from tests.engine.tiny_models import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "gemma3", arch="gemma3_text", seed=3,
                                    sliding_window=12)  # fmt: skip
    prompts = [[5, 6, 7] * 6, [5, 6, 7] * 6 + [9, 10], [11, 12] * 9]  # a prefix hit
    outputs, replays = {}, []
    for backend in ("sdpa", "triton"):
        engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32",
                                        device=str(device), num_blocks=64, block_size=4,
                                        attention_backend=backend, max_num_seqs=4,
                                        max_num_batched_tokens=32))  # fmt: skip
        assert [b.window for b in engine.core.model.attn_backends] == [None, 12]
        if backend == "triton" and device.type == "cuda":
            assert engine.core.runner.graphs is not None  # captured at start-up
        elif backend == "triton":  # CPU: the stand-in capture (tests/engine/test_cuda_graphs.py)
            graphs = CudaGraphRunner(engine.core.model, engine.core.runner.kv_caches, 4,
                                     engine.core.max_model_len, 4, device)  # fmt: skip
            capture = RerunCapture()
            graphs.capture(capture)
            engine.core.runner.graphs = graphs
            replays = capture.replays
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), ids, SamplingParams(max_tokens=12, temperature=0.0))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        outputs[backend] = done
    assert outputs["triton"] == outputs["sdpa"]
    assert device.type == "cuda" or 4 in replays  # 3 decodes padded to 4


def test_a_hybrid_steps_buffers_hold_each_groups_tables_and_slots():
    from engine.cuda_graphs import DecodeBuffers
    from scheduler import ScheduledRequest

    # Request r: 20 + r tokens in blocks of 4; the windowed group's first blocks are gone.
    full = [tuple(range(10 * r, 10 * r + 6)) for r in range(3)]
    windowed = [(0, 0, 0, 40 + r, 50 + r, 60 + r) for r in range(3)]
    step = [ScheduledRequest(None, str(r), [7], 20 + r, full[r], True,
                             group_block_ids=(windowed[r],)) for r in range(3)]  # fmt: skip
    buffers = DecodeBuffers(4, max_blocks=8, device=torch.device("cpu"), groups=2)
    buffers.load(step, size=4, block_size=4)
    meta = buffers.metadata(4, max_seq_len=32, block_size=4)
    for group, tables in enumerate((full, windowed)):
        view = meta.for_group(group)
        assert view.block_tables[:3, :6].tolist() == [list(t) for t in tables]
        want = [tables[r][(20 + r) // 4] * 4 + (20 + r) % 4 for r in range(3)]
        assert view.slot_mapping.tolist() == [*want, -1]  # the padding row writes nothing
        assert view.seq_lens.tolist() == [21, 22, 23, 0]
