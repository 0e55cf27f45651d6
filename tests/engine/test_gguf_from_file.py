"""MXFP4 served from the mapped file's own blocks (engine/quantization/gguf.py's `FROM_FILE`,
taken for a file larger than `COPY_SHARE` of the memory available): the kernel reads the
file's layout 8 rows at a time, regrouped in registers, and gives the bits the regrouped copy
in memory gives, at every activation row count and in a whole model (the tiny gpt-oss of
test_gguf_gpt_oss.py, MXFP4 experts beside Q8_0), prefill and decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

import engine.quantization.gguf as gguf_method
from engine import LLM
from engine.kernels import ggml_kernels
from tests.engine.gguf_models import bpe_vocab, text_logits_of, write_family_gguf
from tests.engine.test_engine_golden import engine_greedy, random_prompts
from tests.engine.test_gguf_gpt_oss import _model

pytestmark = pytest.mark.skipif(ggml_kernels() is None, reason="the GGUF kernels need AVX2")


def _mxfp4_blocks(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random MXFP4 rows: scale bytes 2^-9..2^-5 (finite, small values), random nibbles."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 32, 17), dtype=np.uint8)
    blocks[..., 0] = rng.integers(118, 123, (rows, cols // 32), dtype=np.uint8)
    return torch.from_numpy(blocks.reshape(rows, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_files_layout_gives_the_regrouped_copys_bits(dtype):
    kernels = ggml_kernels()
    # 24 rows: a task of 16 and one of 8; 56: four tasks; 20 rows stay a row at a time in both
    for rows, cols in ((24, 64), (56, 256), (20, 96)):
        blocks = _mxfp4_blocks(rows, cols, seed=rows)
        regrouped, qtype = kernels.ggml_repack(blocks, int(T.MXFP4), cols)
        assert (qtype != int(T.MXFP4)) == (rows % 8 == 0)
        for m in range(1, 10):  # every tile height, and the AVX-512 pairs' 4-8 rows
            x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m)).to(dtype)
            file = kernels.ggml_linear(x, [blocks], [int(T.MXFP4)])
            assert torch.equal(file, kernels.ggml_linear(x, [regrouped], [qtype])), (rows, m)


def test_a_strided_view_of_the_stacked_experts_is_read_in_place():
    # An expert is rows of the stacked tensor: a view, its rows a stack's stride apart.
    kernels = ggml_kernels()
    stacked = _mxfp4_blocks(3 * 32, 128, seed=1)
    x = torch.randn(3, 128)
    for e in range(3):
        view = stacked[32 * e : 32 * (e + 1)]
        expected = kernels.ggml_linear(x, [view.clone()], [int(T.MXFP4)])
        assert torch.equal(kernels.ggml_linear(x, [view], [int(T.MXFP4)]), expected)


@pytest.fixture(scope="module")
def mxfp4_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("from_file") / "mxfp4.gguf"
    return write_family_gguf(path, _model(), bpe_vocab(), qtype=T.Q8_0, expert_qtype=T.MXFP4)


def _expert_types(llm: LLM) -> set[int]:
    model = llm.engine.core.model
    return {t for lin in model.linears() if lin.method.ggml for t in lin.method.ggml[1]
            if t % 1000 == int(T.MXFP4)}  # fmt: skip


def test_a_model_from_the_file_gives_the_regrouped_models_logits_and_tokens(
    mxfp4_file, tmp_path, monkeypatch
):
    kw = {"model": str(mxfp4_file), "block_size": 4, "num_blocks": 128, "cache_dir": str(tmp_path)}
    regrouped = LLM(**kw)  # a small file: copied
    monkeypatch.setattr(gguf_method, "COPY_SHARE", 0.0)  # as if it did not fit
    from_file = LLM(**kw)
    assert _expert_types(from_file) == {int(T.MXFP4)}  # the file's blocks, no copy
    assert _expert_types(regrouped) == {1000 + int(T.MXFP4)}  # MXFP4x8 copies
    ids = list(range(40, 90))
    assert torch.equal(text_logits_of(from_file, ids), text_logits_of(regrouped, ids))
    prompts = random_prompts(seed=3, n=3, vocab=1000, shared_prefix=12)
    assert engine_greedy(from_file, prompts, 12) == engine_greedy(regrouped, prompts, 12)


def test_the_choice_follows_the_memory_available_unless_told(monkeypatch):
    monkeypatch.delenv(gguf_method.MAPPED_ENV, raising=False)
    assert gguf_method.choose_mapped(16 << 30, 20 << 30) == {"MXFP4"}  # more than 3/4
    assert gguf_method.choose_mapped(12 << 30, 20 << 30) == frozenset()
    monkeypatch.setenv(gguf_method.MAPPED_ENV, "always")
    assert gguf_method.choose_mapped(1 << 20, 20 << 30) == {"MXFP4"}
    monkeypatch.setenv(gguf_method.MAPPED_ENV, "never")
    assert gguf_method.choose_mapped(12 << 30, 20 << 30) == frozenset()
    monkeypatch.setenv(gguf_method.MAPPED_ENV, "sometimes")
    with pytest.raises(ValueError, match="auto, always or never"):
        gguf_method.choose_mapped(1, 1)
