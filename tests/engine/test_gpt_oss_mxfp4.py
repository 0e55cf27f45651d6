"""gpt-oss' own checkpoints, experts in MXFP4 blocks (engine/hf_mxfp4.py): the blocks
repacked for ggml dequantize as transformers dequantizes the checkpoint's; float32 greedy
tokens equal transformers' on the same checkpoint (it dequantizes them, exactly); the
default plan serves the experts from those blocks within the int8-activation bound; a
checkpoint missing half of a pair is refused by name."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType, quants
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from engine import LLM, SamplingParams
from engine.errors import ModelFileError
from engine.hf_mxfp4 import ggml_blocks
from engine.kernels import ggml_kernels
from tests.engine.gguf_models import relative_error, text_logits_of
from tests.engine.test_engine_golden import (
    assert_all_blocks_free,
    engine_greedy,
    hf_greedy,
    random_prompts,
)
from tests.engine.tiny_models import make_mxfp4_gpt_oss_dir

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_mxfp4_gpt_oss_dir(tmp_path_factory.mktemp("gpt_oss_mxfp4"), seed=4)
    prompts = random_prompts(seed=6, n=4, vocab=1000, shared_prefix=20)
    return path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


def test_repacked_blocks_dequantize_as_transformers_dequantizes_the_checkpoint():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 5, 4), generator=gen, dtype=torch.uint8)
    scales[0, 0, :2] = torch.tensor([1, 127], dtype=torch.uint8)  # tiny, and one
    # transformers: [experts, rows, groups, 16] -> [experts, cols, rows]
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    for e in range(3):
        repacked = ggml_blocks(blocks[e], scales[e])
        got = quants.dequantize(repacked.numpy(), GGMLQuantizationType.MXFP4)
        torch.testing.assert_close(torch.from_numpy(got), expected[e], rtol=0, atol=0)


def test_float32_tokens_equal_transformers_on_the_checkpoint(checkpoint):
    path, prompts, expected = checkpoint
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_blocks=256)
    assert engine_greedy(llm, prompts, NEW_TOKENS) == expected
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
                        use_tqdm=False)  # fmt: skip
    assert [o.token_ids for o in outs] == expected  # again, from the prefix cache
    assert all(o.num_cached_tokens > 0 for o in outs)
    assert_all_blocks_free(llm)


@pytest.mark.skipif(ggml_kernels() is None, reason="the GGUF kernels did not build")
def test_the_default_plan_serves_the_experts_from_their_blocks(checkpoint):
    path, prompts, _ = checkpoint
    llm = LLM(model=str(path), num_blocks=64)
    experts = llm.engine.core.model.layers[0].mlp.experts[0]
    assert experts.gate_up_proj.formats() == ["MXFP4", "MXFP4"]
    assert experts.down_proj.formats() == ["MXFP4"]
    exact = LLM(model=str(path), dtype="float32", num_blocks=64)
    ids = prompts[0] + prompts[1]
    assert relative_error(text_logits_of(llm, ids), text_logits_of(exact, ids)) < 0.03


def test_a_checkpoint_without_its_scales_is_refused_by_name(checkpoint, tmp_path):
    path, _, _ = checkpoint
    for file in path.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (weights,) = tmp_path.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(
        ModelFileError, match=r"layers\.1\.mlp\.experts\.down_proj_scales is missing"
    ):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64)
