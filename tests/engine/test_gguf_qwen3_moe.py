"""Qwen3-MoE GGUFs (llama.cpp's architecture `qwen3moe`) read into transformers' config and
per-expert tensors of `Qwen3MoeForCausalLM`: the router (`ffn_gate_inp`) and each expert
projection stacked in one [experts, rows, columns] tensor (`ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`), handed on one expert at a time, its blocks rows of the mapped file.

The tiny model is written as llama.cpp's convert_hf_to_gguf writes it
(tests/engine/gguf_models.py; checked by hand against that converter's file of the same
model: the same keys, tensor names, shapes and bytes)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from engine import LLM
from engine.errors import ModelFileError
from engine.gguf_config import gguf_config
from engine.gguf_file import GGUFFile
from engine.gguf_weights import GGUFTensor, read_tensors
from engine.loader import gguf_shapes
from tests.engine.gguf_models import bpe_vocab, relative_error, text_logits_of, write_family_gguf
from tests.engine.test_engine_golden import engine_greedy, hf_greedy

# 8 experts of 32 columns, 2 a token, every layer sparse (llama.cpp's qwen3moe has no dense
# layer), the chosen probabilities rescaled to sum to 1 (as llama.cpp always does for it)
CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "norm_topk_prob": True, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
          "tie_word_embeddings": False}  # fmt: skip


@lru_cache(maxsize=1)
def _model() -> Qwen3MoeForCausalLM:
    vocab = bpe_vocab("qwen2")
    config = Qwen3MoeConfig(**CONFIG, vocab_size=len(vocab["tokens"]), bos_token_id=vocab["bos"],
                            eos_token_id=vocab["eos"], pad_token_id=vocab["pad"],
                            architectures=["Qwen3MoeForCausalLM"])  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).float().eval()
    with torch.no_grad():  # identity norms would hide a slip; a wider router spreads choices
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    return model


def _hf_names(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' in-memory tensor as the per-expert tensors of its checkpoints."""
    head = name.removesuffix("gate_up_proj").removesuffix("down_proj")
    if name.endswith("experts.gate_up_proj"):
        gate, up = tensor.chunk(2, dim=1)
        return {**{f"{head}{e}.gate_proj.weight": w for e, w in enumerate(gate)},
                **{f"{head}{e}.up_proj.weight": w for e, w in enumerate(up)}}  # fmt: skip
    if name.endswith("experts.down_proj"):
        return {f"{head}{e}.down_proj.weight": w for e, w in enumerate(tensor)}
    return {name: tensor}


def _reference() -> dict[str, torch.Tensor]:
    state = {}
    for name, tensor in _model().state_dict().items():
        state |= _hf_names(name, tensor)
    return state


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3moe")
    model, vocab = _model(), bpe_vocab("qwen2")
    return {"f32": write_family_gguf(root / "f32.gguf", model, vocab),
            "q8_0": write_family_gguf(root / "q8_0.gguf", model, vocab, qtype=T.Q8_0),
            "mxfp4": write_family_gguf(root / "mxfp4.gguf", model, vocab, qtype=T.Q8_0,
                                       expert_qtype=T.MXFP4)}  # fmt: skip


def test_config_is_the_models_own(files):
    reference = _model().config
    config = gguf_config(GGUFFile(files["f32"]))
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["model_type"] == "qwen3_moe"
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "hidden_size",
                  "num_hidden_layers", "head_dim", "norm_topk_prob", "decoder_sparse_step"):  # fmt: skip
        assert config[field] == getattr(reference, field), field
    assert config["mlp_only_layers"] == []


def test_every_expert_is_its_own_tensor(files):
    reference = _reference()
    weights = dict(read_tensors(files["f32"]))
    assert weights.keys() == reference.keys()
    for name, expected in reference.items():
        assert torch.equal(weights[name], expected), name
    shapes = gguf_shapes(GGUFFile(files["f32"]))
    assert shapes == {name: tuple(t.shape) for name, t in reference.items()}


def test_q8_0_experts_are_rows_of_the_files_blocks(files):
    reference = _reference()
    weights = dict(read_tensors(files["q8_0"]))
    experts = 0
    for name, expected in reference.items():
        if ".experts." not in name:
            continue
        weight = weights[name]
        assert isinstance(weight, GGUFTensor) and weight.mapped and weight.type == T.Q8_0
        assert weight.shape == tuple(expected.shape)
        assert np.array_equal(weight.blocks.numpy(), quants.quantize(expected.numpy(), T.Q8_0))
        experts += 1
    assert experts == 2 * 8 * 3


def test_the_engine_serves_the_file_with_transformers_greedy_tokens(files, tmp_path):
    prompts = [[5, 17, 300, 42, 99, 7, 250, 11], list(range(40, 75))]
    expected = hf_greedy(None, prompts, 12, hf=_model())
    llm = LLM(model=str(files["f32"]), dtype="float32", block_size=4, num_blocks=128,
              cache_dir=str(tmp_path))  # fmt: skip
    assert engine_greedy(llm, prompts, 12) == expected
    q8 = LLM(model=str(files["q8_0"]), block_size=4, num_blocks=128, cache_dir=str(tmp_path))
    plan = q8.engine.core.config.plan
    assert plan.weights.startswith("projections Q8_0 x")  # the experts from their blocks
    assert "dequantized" not in plan.weights
    assert len(engine_greedy(q8, prompts, 12)[0]) == 12


def test_mxfp4_experts_serve_from_their_blocks(files, tmp_path):
    # llama-quantize's MXFP4_MOE mix (gpt-oss' downloads): the experts in MXFP4, the rest
    # Q8_0. The experts stay the file's 17-byte blocks, and the logits are those of the
    # same file's weights made float32, within int8-activation rounding.
    weights = dict(read_tensors(files["mxfp4"]))
    experts = [w for name, w in weights.items() if ".experts." in name]
    assert len(experts) == 2 * 8 * 3 and all(w.type == T.MXFP4 and w.mapped for w in experts)
    llm = LLM(model=str(files["mxfp4"]), block_size=4, num_blocks=128, cache_dir=str(tmp_path))
    plan = llm.engine.core.config.plan
    assert "MXFP4 x" in plan.weights and "dequantized" not in plan.weights, plan.weights
    exact = LLM(model=str(files["mxfp4"]), dtype="float32", block_size=4, num_blocks=128,
                cache_dir=str(tmp_path))  # fmt: skip
    ids = list(range(40, 90))
    assert relative_error(text_logits_of(llm, ids), text_logits_of(exact, ids)) < 0.03


def test_a_file_with_fewer_experts_than_it_says_is_refused(files, tmp_path):
    gguf = GGUFFile(files["f32"])
    gguf.metadata["qwen3moe.expert_count"] = 1 << 30  # a crafted count: refused, not counted
    from engine.model_check import check_config
    from engine.model_config import ModelConfig

    with pytest.raises(ModelFileError, match="gate.weight is \\[8, 64\\]"):
        check_config(ModelConfig(**gguf_config(gguf)), gguf_shapes(gguf), files["f32"])
