"""Qwen3.5 GGUFs (llama.cpp's architecture `qwen35`) read into transformers' own config and
tensors of `Qwen3_5ForCausalLM` (engine/gguf_config.py, engine/gguf_weights.py).

A tiny random Qwen3.5 (three linear-attention layers, then a full-attention one; two value
heads per key head, so the converter's value-head reordering is in play) is written as
llama.cpp's convert_hf_to_gguf writes it (tests/engine/gguf_models.py; checked by hand
against a file of that converter for the same model: the same keys, tensor names, types
and bytes), and read back: the config transformers holds, every tensor of its state_dict
under its name with its values, and a Q8_0 file's projections as blocks the kernels
multiply."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants
from transformers import AutoConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from engine import LLM
from engine.gguf_config import gguf_config
from engine.gguf_file import GGUFFile
from engine.gguf_weights import NATIVE_TYPES, GGUFTensor, hf_name, read_tensors
from engine.kernels import ggml_kernels
from tests.engine.gguf_models import bpe_vocab, random_blocks, write_family_gguf
from tests.engine.test_engine_golden import engine_greedy, hf_greedy

# hidden 64; full attention: 4 query heads of 32 (each with its output gate: q_proj has
# 256 rows), 2 KV heads, rotary on a quarter of a head; linear attention: 2 key heads and
# 4 value heads, all of 32 (llama.cpp's qwen35 needs key and value heads of one size; a
# Q8_0 block: out_proj's columns move as whole blocks). llama-server serves the converter's
# file of it with transformers' greedy tokens.
CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
          "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
          "layer_types": ["linear_attention"] * 3 + ["full_attention"],
          "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                              "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                              "mrope_interleaved": True}}  # fmt: skip
# The config fields transformers' Qwen3_5TextConfig has and the GGUF must give back
FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
          "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
          "attention_bias", "layer_types", "linear_conv_kernel_dim", "linear_key_head_dim",
          "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
          "bos_token_id", "eos_token_id", "pad_token_id")  # fmt: skip


@lru_cache(maxsize=1)
def _model() -> Qwen3_5ForCausalLM:
    vocab = _vocab()
    config = Qwen3_5TextConfig(**CONFIG, vocab_size=len(vocab["tokens"]), bos_token_id=vocab["bos"],
                               eos_token_id=vocab["eos"], pad_token_id=vocab["pad"],
                               architectures=["Qwen3_5ForCausalLM"])  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).float().eval()
    with torch.no_grad():  # identity norms, A and dt_bias as initialised would hide a slip
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("A_log", "dt_bias")):
                param.uniform_(-0.5, 0.5)
    return model


@lru_cache(maxsize=1)
def _vocab() -> dict:
    return bpe_vocab("qwen35")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen35")
    model, vocab = _model(), _vocab()
    return {"f32": write_family_gguf(root / "f32.gguf", model, vocab),
            "q8_0": write_family_gguf(root / "q8_0.gguf", model, vocab, qtype=T.Q8_0),
            "mtp": write_family_gguf(root / "mtp.gguf", model, vocab, mtp=True)}  # fmt: skip


def _f32(value):
    """Numbers as float32 (a GGUF stores eps and rope bases in float32)."""
    if isinstance(value, float):
        return float(np.float32(value))
    if isinstance(value, dict):
        return {k: _f32(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_f32(v) for v in value]
    return value


def test_config_is_the_models_own(files):
    reference = _model().config
    config = gguf_config(GGUFFile(files["f32"]))
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["model_type"] == "qwen3_5_text"
    for field in FIELDS:
        assert _f32(config[field]) == _f32(getattr(reference, field)), field
    # and transformers takes it as it is: the same config, field for field
    theirs = AutoConfig.for_model(**config).to_dict()
    for key, value in reference.to_dict().items():
        if key not in ("_name_or_path", "dtype", "transformers_version"):
            assert _f32(theirs.get(key)) == _f32(value), key


def test_layer_types_without_the_recurrent_layers_key_follow_the_interval(files):
    gguf = GGUFFile(files["f32"])
    del gguf.metadata["qwen35.attention.recurrent_layers"]
    assert gguf_config(gguf)["layer_types"] == CONFIG["layer_types"]  # every 4th full
    gguf.metadata["qwen35.full_attention_interval"] = 2
    assert gguf_config(gguf)["layer_types"] == ["linear_attention", "full_attention"] * 2


def test_tensors_are_the_state_dict(files):
    reference = _model().state_dict()
    weights = dict(read_tensors(files["f32"]))
    assert weights.keys() == reference.keys()
    for name, expected in reference.items():
        weight = weights[name]
        assert isinstance(weight, torch.Tensor) and weight.dtype == torch.float32, name
        assert weight.shape == expected.shape, name
        if name.endswith("norm.weight") and ".linear_attn." not in name:
            # stored w + 1 in float32: w back to the rounding of that sum, exactly
            assert torch.equal(weight, (expected + 1) - 1), name
            assert torch.allclose(weight, expected, rtol=0, atol=6e-8), name
        elif name.endswith(".A_log"):  # stored A = -exp(A_log) in float32: log(-A) of it
            assert torch.equal(weight, torch.exp(expected).double().log().float()), name
            assert torch.allclose(weight, expected, rtol=0, atol=1.2e-7), name
        else:  # moved (value heads, conv1d's dimension) but never rounded: bit for bit
            assert torch.equal(weight, expected), name


def test_q8_0_projections_come_as_blocks_the_kernels_multiply(files):
    reference = _model().state_dict()
    weights = dict(read_tensors(files["q8_0"]))
    assert weights.keys() == reference.keys()
    native = ggml_kernels() is not None
    blocks = 0
    for name, expected in reference.items():
        weight = weights[name]
        if expected.dim() == 2:  # every projection, the embedding and the head
            assert isinstance(weight, GGUFTensor) and weight.type == T.Q8_0, name
            assert weight.type in NATIVE_TYPES and weight.native == native, name
            assert weight.shape == tuple(expected.shape), name
            # Q8_0 of the weights in transformers' order: the reordering moved whole rows
            # and whole blocks, so the blocks are those of the model's own tensor
            quantized = quants.quantize(expected.numpy(), T.Q8_0)
            assert np.array_equal(weight.blocks.numpy(), quantized), name
            blocks += 1
        else:  # norms, A_log, dt_bias; the conv1d kernel, which the converter keeps F32
            assert isinstance(weight, torch.Tensor) and weight.dtype == torch.float32, name
            assert torch.allclose(weight, expected, rtol=0, atol=1.2e-7), name
    assert blocks == 2 + 3 * 8 + 7  # embedding, head; the linear layers; the full one


def test_the_mtp_block_is_no_layer_of_the_model(files):
    # the converter writes a checkpoint's multi-token-prediction block after the layers
    gguf = GGUFFile(files["mtp"])
    assert gguf.metadata["qwen35.block_count"] == 5
    assert gguf_config(gguf) == gguf_config(GGUFFile(files["f32"]))
    assert dict(read_tensors(files["mtp"])).keys() == _model().state_dict().keys()
    assert hf_name("blk.4.nextn.eh_proj.weight", arch="qwen35") is None
    assert hf_name("blk.4.attn_q.weight", arch="qwen35", layers=4) is None


def test_converter_names():
    names = {"blk.0.attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
             "blk.0.attn_gate.weight": "linear_attn.in_proj_z.weight",
             "blk.0.ssm_alpha.weight": "linear_attn.in_proj_a.weight",
             "blk.0.ssm_beta.weight": "linear_attn.in_proj_b.weight",
             "blk.0.ssm_a": "linear_attn.A_log", "blk.0.ssm_dt.bias": "linear_attn.dt_bias",
             "blk.0.ssm_conv1d.weight": "linear_attn.conv1d.weight",
             "blk.0.ssm_norm.weight": "linear_attn.norm.weight",
             "blk.0.ssm_out.weight": "linear_attn.out_proj.weight",
             "blk.0.post_attention_norm.weight": "post_attention_layernorm.weight",
             "blk.0.attn_q.weight": "self_attn.q_proj.weight",
             "blk.0.attn_q_norm.weight": "self_attn.q_norm.weight"}  # fmt: skip
    for gguf_name, name in names.items():
        assert hf_name(gguf_name, arch="qwen35") == f"model.layers.0.{name}"


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K])
def test_columns_move_as_whole_blocks_or_else_dequantized(qtype):
    # out_proj's columns come back in transformers' order: block by block where a value
    # head is whole blocks (Q8_0's 32 columns), else dequantized (a 256-wide Q4_K block
    # holding two heads of 128)
    rng = np.random.default_rng(0)
    rows, cols = 4, 512
    tensor = GGUFTensor(torch.from_numpy(random_blocks(qtype, rows, cols, rng)), qtype,
                        (rows, cols))  # fmt: skip
    dense = tensor.dequantize()
    heads = torch.arange(cols).view(2, 2, 128).transpose(0, 1).reshape(-1)  # 128-wide heads
    moved = tensor.select_columns(heads)
    if qtype == T.Q8_0:
        assert isinstance(moved, GGUFTensor) and moved.type == qtype
        moved = moved.dequantize()
    else:
        assert isinstance(moved, torch.Tensor)
    assert torch.equal(moved, dense[:, heads])


def test_the_engine_serves_the_file_with_transformers_greedy_tokens(files, tmp_path):
    """The F32 file, multi-token prediction block and all, through the engine: token for
    token transformers' greedy output on the model it was written from."""
    prompts = [[5, 17, 300, 42, 99, 7, 250, 11], list(range(40, 75))]
    expected = hf_greedy(None, prompts, 12, hf=_model())
    llm = LLM(model=str(files["mtp"]), dtype="float32", block_size=4, num_blocks=128,
              state_slots=16, cache_dir=str(tmp_path))  # fmt: skip
    assert engine_greedy(llm, prompts, 12) == expected
    q8 = LLM(model=str(files["q8_0"]), block_size=4, num_blocks=128, state_slots=16,
             cache_dir=str(tmp_path))  # fmt: skip
    assert "Q8_0" in q8.engine.core.config.plan.weights
    assert len(engine_greedy(q8, prompts, 12)[0]) == 12
