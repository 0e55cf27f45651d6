"""gpt-oss GGUFs (llama.cpp's architecture `gpt-oss`): the config read from the file's keys
(YaRN, the window, the experts; the SwiGLU's limit as llama.cpp hard-codes it), attention
sinks, the router and its bias, and each stacked expert tensor (weights and biases) handed
on one expert at a time. The tiny model is written as llama.cpp's convert_hf_to_gguf writes
it (tests/engine/gguf_models.py; checked against that converter's file of the same model:
the same keys and values, tensor names, shapes, types and bytes), in float32 and as
llama-quantize's MXFP4_MOE mix (MXFP4 experts, Q8_0 beside them)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine import LLM
from engine.gguf_config import gguf_config
from engine.gguf_file import GGUFFile
from engine.gguf_weights import GGUFTensor, read_tensors
from engine.kernels import ggml_kernels
from tests.engine.gguf_models import bpe_vocab, relative_error, text_logits_of, write_family_gguf
from tests.engine.test_engine_golden import engine_greedy, hf_greedy, random_prompts
from tests.engine.tiny_models import tiny_config


@lru_cache(maxsize=1)
def _model():
    """The tiny gpt-oss of tests/engine/tiny_models.py with the released models' SwiGLU
    limit (7.0: a GGUF does not carry it)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(4)
    model = AutoModelForCausalLM.from_config(tiny_config("gpt_oss", swiglu_limit=7.0),
                                             dtype=torch.float32).eval()  # fmt: skip
    with torch.no_grad():  # norms, biases and sinks away from transformers' 1 and 0
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
            elif name.endswith(("bias", "sinks")):
                param.normal_(0.0, 1.0 if name.endswith("sinks") else 0.1)
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpt_oss_gguf")
    model, vocab = _model(), bpe_vocab()
    return {"f32": write_family_gguf(root / "f32.gguf", model, vocab),
            "mxfp4": write_family_gguf(root / "mxfp4.gguf", model, vocab, qtype=T.Q8_0,
                                       expert_qtype=T.MXFP4)}  # fmt: skip


def test_config_is_the_models_own(files):
    reference = _model().config
    config = gguf_config(GGUFFile(files["f32"]))
    assert config["architectures"] == ["GptOssForCausalLM"] and config["model_type"] == "gpt_oss"
    for field in ("num_experts_per_tok", "intermediate_size", "sliding_window", "layer_types",
                  "head_dim", "attention_bias", "swiglu_limit", "swiglu_alpha"):  # fmt: skip
        assert config[field] == getattr(reference, field), field
    assert config["num_experts"] == reference.num_local_experts
    ours, theirs = config["rope_parameters"], reference.rope_parameters
    assert {k: ours[k] for k in theirs} == theirs  # YaRN, truncate False included


def test_experts_and_their_biases_are_each_experts_own(files):
    weights = dict(read_tensors(files["mxfp4"]))
    state = _model().state_dict()
    gate_up = state["model.layers.0.mlp.experts.gate_up_proj_bias"]
    for e in range(8):
        x = f"model.layers.0.mlp.experts.{e}."
        assert torch.equal(weights[x + "gate_proj.bias"], gate_up[e, ::2])
        assert torch.equal(weights[x + "up_proj.bias"], gate_up[e, 1::2])
        assert isinstance(weights[x + "down_proj.weight"], GGUFTensor)
        assert weights[x + "down_proj.weight"].type == T.MXFP4
    assert torch.equal(weights["model.layers.1.self_attn.sinks"],
                       state["model.layers.1.self_attn.sinks"])  # fmt: skip
    assert torch.equal(weights["model.layers.1.mlp.router.bias"],
                       state["model.layers.1.mlp.router.bias"])  # fmt: skip


def test_the_engine_serves_the_file_with_transformers_greedy_tokens(files, tmp_path):
    prompts = random_prompts(seed=6, n=3, vocab=1000, shared_prefix=20)
    expected = hf_greedy(None, prompts, 12, hf=_model())
    assert len({t for out in expected for t in out}) > 6  # not one token repeated
    llm = LLM(model=str(files["f32"]), dtype="float32", block_size=4, num_blocks=128,
              cache_dir=str(tmp_path))  # fmt: skip
    assert engine_greedy(llm, prompts, 12) == expected


def test_mxfp4_experts_serve_from_their_blocks(files, tmp_path):
    # The experts stay the file's 17-byte blocks; the logits are those of the same file's
    # weights made float32, within int8-activation rounding.
    llm = LLM(model=str(files["mxfp4"]), block_size=4, num_blocks=128, cache_dir=str(tmp_path))
    plan = llm.engine.core.config.plan
    assert "MXFP4 x" in plan.weights and "dequantized" not in plan.weights, plan.weights
    exact = LLM(model=str(files["mxfp4"]), dtype="float32", block_size=4, num_blocks=128,
                cache_dir=str(tmp_path))  # fmt: skip
    ids = list(range(40, 90))
    got = text_logits_of(llm, ids)
    assert relative_error(got, text_logits_of(exact, ids)) < 0.03


@pytest.mark.skipif(ggml_kernels() is None, reason="the paged kernels need AVX2")
def test_the_paged_kernel_takes_the_sinks(files, tmp_path):
    # The plan's attention for the blocks (the paged kernel of the dtype's build, sinks
    # added where it merges a row's chunks) against SDPA's (sinks through the log-sum-exp):
    # the same weights and ops but the attention, so the logits differ by its rounding.
    kw = {"model": str(files["mxfp4"]), "block_size": 4, "num_blocks": 128,
          "cache_dir": str(tmp_path)}  # fmt: skip
    paged, sdpa = LLM(**kw), LLM(**kw, attention_backend="sdpa")
    plan = paged.engine.core.config.plan
    assert plan.attention == "cpu-paged"
    ids = list(range(40, 90))
    # float32: 1.2e-7 measured (Zen 3); bf16 (AVX512-BF16 CPUs) rounds each attention output,
    # and the int8 activations after it can round the other way. Without the sinks: 0.39.
    bound = 1e-3 if plan.dtype == torch.float32 else 0.03
    assert relative_error(text_logits_of(paged, ids), text_logits_of(sdpa, ids)) < bound


def test_a_file_with_fewer_experts_than_it_says_is_refused(files):
    # A crafted expert count is refused against the router's rows before it is counted out.
    from engine.errors import ModelFileError
    from engine.loader import gguf_shapes
    from engine.model_check import check_config
    from engine.model_config import ModelConfig

    gguf = GGUFFile(files["mxfp4"])
    gguf.metadata["gpt-oss.expert_count"] = 1 << 30
    with pytest.raises(ModelFileError, match="router.weight is \\[8, 64\\]"):
        check_config(ModelConfig(**gguf_config(gguf)), gguf_shapes(gguf), files["mxfp4"])
    gguf.metadata["gpt-oss.expert_count"] = 8  # and an expert bias of another width
    shapes = gguf_shapes(gguf)
    shapes["model.layers.1.mlp.experts.3.up_proj.bias"] = (31,)
    with pytest.raises(ModelFileError, match="experts.3.up_proj.bias is \\[31\\]"):
        check_config(ModelConfig(**gguf_config(gguf)), shapes, files["mxfp4"])
