"""A GGUF's config.json and generation_config.json, from the file's own metadata.

llama.cpp's converter (`convert_hf_to_gguf.py`) writes a model's shape under its own key
names (`{arch}.block_count`, `{arch}.attention.head_count`, ...) and leaves out what its
loader hard-codes per architecture (Gemma 3's sliding-window pattern and local rope base,
SmolLM3's layers without rope). This module reverses it into the dict transformers' config
class of the family holds (the field names and values `engine/model_config.py` reads), for
the architectures llama.cpp writes as `llama` (Llama, Mistral, SmolLM2), `qwen2`, `qwen3`,
`gemma3`, `smollm3`, `phi3`, `qwen35` (Qwen3.5's text model), `qwen3moe` and `gpt-oss`; no
transformers import, no tensor read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from engine.errors import ModelFileError
from engine.gguf_file import ArrayInfo, GGUFFile

# llama.cpp's architecture -> (transformers' model_type, its CausalLM class).
MODEL_TYPES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "smollm3": ("smollm3", "SmolLM3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM"),
}
# llama.cpp's loader: every 6th Gemma 3 layer is global, the others slide, at base 10,000
# (llama-model.cpp, `set_swa_pattern(6)`, `rope_freq_base_train_swa`); every 4th SmolLM3
# layer has no rope (`n_no_rope_layer_step = 4`).
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
SMOLLM3_NO_ROPE_INTERVAL = 4
# Qwen3.5: every 4th layer full attention, the others linear (Gated DeltaNet), where a file
# has neither `attention.recurrent_layers` nor `full_attention_interval` (transformers'
# default too); its rotary sections, which text positions never tell apart (t = h = w)
QWEN35_FULL_ATTENTION_INTERVAL = 4
QWEN35_MROPE_SECTION = [11, 11, 10]
_ROPE_SCALING_TYPES = ("linear", "yarn", "longrope")
# llama.cpp's gpt-oss experts (llm_build_openai_moe_iswa: swiglu_oai)
GPT_OSS_SWIGLU_ALPHA, GPT_OSS_SWIGLU_LIMIT = 1.702, 7.0


class _Keys:
    """The metadata of one architecture: ``need("block_count")`` or ``get(...)``."""

    def __init__(self, gguf: GGUFFile, arch: str) -> None:
        self.gguf, self.arch = gguf, arch

    def get(self, name: str, default: Any = None) -> Any:
        value = self.gguf.metadata.get(f"{self.arch}.{name}", default)
        return default if isinstance(value, ArrayInfo) else value

    def need(self, name: str) -> Any:
        value = self.get(name)
        if value is None:
            raise ModelFileError(f"{self.gguf.path}: metadata key {self.arch}.{name} is missing")
        return value


def gguf_architecture(gguf: GGUFFile) -> str:
    """llama.cpp's architecture name, with a llama file named "mistral" as transformers
    reads it (llama.cpp writes Mistral as `llama`)."""
    arch = gguf.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{gguf.path}: metadata key general.architecture is missing")
    if arch == "llama" and gguf.metadata.get("general.name") == "mistral":
        return "mistral"
    return arch


def gguf_config(gguf: GGUFFile) -> dict[str, Any]:
    """The config.json dict of the model in ``gguf``; `ModelFileError` for an architecture
    this module does not know or a required key the file lacks."""
    arch = gguf_architecture(gguf)
    if arch not in MODEL_TYPES:
        raise ModelFileError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported (supported: "
            f"{', '.join(sorted(MODEL_TYPES))})"
        )
    keys = _Keys(gguf, "llama" if arch == "mistral" else arch)
    tensors = {t.name for t in gguf.tensors}
    model_type, architecture = MODEL_TYPES[arch]
    heads = keys.need("attention.head_count")
    hidden = keys.need("embedding_length")
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": _vocab_size(gguf, keys),
        "hidden_size": hidden,
        "intermediate_size": keys.need("feed_forward_length"),
        # Qwen3.5's multi-token-prediction layers follow the model's in the block count
        "num_hidden_layers": keys.need("block_count") - (keys.get("nextn_predict_layers") or 0),
        "num_attention_heads": heads,
        "num_key_value_heads": keys.get("attention.head_count_kv", heads),
        "max_position_embeddings": keys.need("context_length"),
        "rms_norm_eps": keys.need("attention.layer_norm_rms_epsilon"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "rope_parameters": _rope_parameters(keys),
        **_token_ids(gguf),
    }
    head_dim = keys.get("attention.key_length") or keys.get("rope.dimension_count")
    if head_dim is not None and arch not in ("qwen2", "phi3"):
        config["head_dim"] = head_dim
    if "rope_freqs.weight" in tensors and config["rope_parameters"]["rope_type"] == "default":
        rotary = keys.get("rope.dimension_count") or head_dim or hidden // heads
        config["rope_parameters"] = _llama3_rope(gguf, config["rope_parameters"], rotary)
    _FAMILY.get(arch, _plain)(config, keys, tensors)
    return config


def _plain(config: dict[str, Any], keys: _Keys, tensors: set[str]) -> None:
    config["hidden_act"] = "silu"
    if config["model_type"] in ("llama", "mistral", "qwen3", "smollm3", "qwen3_moe"):
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if config["model_type"] in ("llama", "smollm3"):
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    window = keys.get("attention.sliding_window")
    if config["model_type"] in ("qwen2", "qwen3", "smollm3", "qwen3_moe"):
        config["use_sliding_window"] = False  # llama.cpp serves them without a window
        config["sliding_window"] = None
    elif config["model_type"] == "mistral":
        config["sliding_window"] = window or None


def _qwen3(config: dict[str, Any], keys: _Keys, tensors: set[str]) -> None:
    _plain(config, keys, tensors)
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]


def _qwen3moe(config: dict[str, Any], keys: _Keys, tensors: set[str]) -> None:
    """Every layer a mixture of experts (llama.cpp's qwen3moe has no dense layer), its top-k
    probabilities always rescaled to sum to 1 (llama.cpp's `build_moe_ffn(..., norm_w =
    true)` for qwen3moe, whatever the checkpoint's norm_topk_prob said)."""
    _qwen3(config, keys, tensors)
    config.update(num_experts=keys.need("expert_count"),
                  num_experts_per_tok=keys.need("expert_used_count"),
                  moe_intermediate_size=keys.need("expert_feed_forward_length"),
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip


def _gpt_oss(config: dict[str, Any], keys: _Keys, tensors: set[str]) -> None:
    """Every layer a mixture of experts (intermediate_size: each expert's width), the
    clamped SwiGLU's alpha and limit as llama.cpp hard-codes them for gpt-oss (1.702, 7.0:
    the released models'), and the layers sliding, full, sliding, ... from the first
    (llama.cpp's `set_swa_pattern(2)`). The converter does not write YaRN's `truncate`: the
    released configs say False."""
    config["hidden_act"] = "silu"
    config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    config["sliding_window"] = keys.need("attention.sliding_window")
    config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                             for i in range(config["num_hidden_layers"])]  # fmt: skip
    config.update(num_experts=keys.need("expert_count"),
                  num_experts_per_tok=keys.need("expert_used_count"),
                  intermediate_size=keys.need("expert_feed_forward_length"),
                  swiglu_alpha=GPT_OSS_SWIGLU_ALPHA, swiglu_limit=GPT_OSS_SWIGLU_LIMIT)  # fmt: skip
    if config["rope_parameters"]["rope_type"] == "yarn":
        config["rope_parameters"]["truncate"] = False


def _smollm3(config: dict[str, Any], keys: _Keys, tensors: set[str]) -> None:
    _qwen3(config, keys, tensors)
    interval = SMOLLM3_NO_ROPE_INTERVAL
    config["no_rope_layer_interval"] = interval
    # transformers' SmolLM3Config: 1 where the layer uses rope, 0 on every 4th
    config["no_rope_layers"] = [int((i + 1) % interval != 0)
                                for i in range(config["num_hidden_layers"])]  # fmt: skip


def _gemma3(config: dict[str, Any], keys: _Keys, tensors: set[str]) -> None:
    layers = config["num_hidden_layers"]
    config["hidden_activation"] = "gelu_pytorch_tanh"
    config["attention_bias"] = False
    config.setdefault("head_dim", 256)  # the converter's default, as transformers'
    # llama.cpp (gemma_pytorch's config): 1/sqrt(head_dim), but hidden/heads on the 27B
    scalar = config["head_dim"]
    if layers == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    config["query_pre_attn_scalar"] = scalar
    window = keys.get("attention.sliding_window")
    global_rope = config["rope_parameters"]
    if window:
        config["sliding_window"] = window
        config["layer_types"] = [
            "full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
            for i in range(layers)
        ]
        local_base = keys.get("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)
        config["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": float(local_base)},
            "full_attention": global_rope,
        }
    else:  # no window in the file: every layer global (llama.cpp's LLAMA_SWA_TYPE_NONE)
        config["sliding_window"] = None
        config["layer_types"] = ["full_attention"] * layers
        config["rope_parameters"] = {"full_attention": global_rope}
    config["final_logit_softcapping"] = keys.get("final_logit_softcapping")
    config["attn_logit_softcapping"] = None


def _phi3(config: dict[str, Any], keys: _Keys, tensors: set[str]) -> None:
    config["hidden_act"] = "silu"
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotary = keys.get("rope.dimension_count", head_dim)
    rope = config["rope_parameters"]
    rope["partial_rotary_factor"] = config["partial_rotary_factor"] = rotary / head_dim
    original = keys.get("rope.scaling.original_context_length")
    config["original_max_position_embeddings"] = original or config["max_position_embeddings"]
    config["sliding_window"] = keys.get("attention.sliding_window") or None  # 0: none
    # LongRoPE's per-frequency factors are tensors (the converter's rope_factors_*)
    factors = {f"{kind}_factor": _float_values(keys.gguf, f"rope_factors_{kind}.weight")
               for kind in ("long", "short")}  # fmt: skip
    if all(factors.values()):
        rope.update(rope_type="longrope", **factors)
        rope["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        rope.pop("factor", None)


def _float_values(gguf: GGUFFile, name: str) -> list[float] | None:
    info = next((t for t in gguf.tensors if t.name == name), None)
    if info is None or info.type.name != "F32" or len(info.shape) != 1:
        return None
    return [float(v) for v in gguf.array(info).view("<f4")]


def _qwen35(config: dict[str, Any], keys: _Keys, tensors: set[str]) -> None:
    """Qwen3.5's text model (transformers' Qwen3_5TextConfig): linear-attention (Gated
    DeltaNet) layers between full-attention ones, whose sizes the converter writes under
    llama.cpp's SSM keys (Qwen3NextModel.set_gguf_parameters), rotary on a part of each head
    (`rope.dimension_count`), interleaved M-RoPE sections (`rope.dimension_sections`)."""
    layers = config["num_hidden_layers"]
    config["hidden_act"] = "silu"
    config["attention_bias"] = any(name.endswith(".attn_q.bias") for name in tensors)
    # (not the rotary width, which is a part of the head here)
    config["head_dim"] = keys.get("attention.key_length") or 256  # transformers' default
    recurrent = keys.gguf.read_array(f"{keys.arch}.attention.recurrent_layers")
    if recurrent is not None and len(recurrent) >= layers:  # (+ False for each MTP layer)
        config["layer_types"] = ["linear_attention" if r else "full_attention"
                                 for r in recurrent[:layers]]  # fmt: skip
    else:
        interval = keys.get("full_attention_interval") or QWEN35_FULL_ATTENTION_INTERVAL
        config["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else
                                 "linear_attention" for i in range(layers)]  # fmt: skip
    value_heads = keys.need("ssm.time_step_rank")
    config["linear_conv_kernel_dim"] = keys.need("ssm.conv_kernel")
    config["linear_key_head_dim"] = keys.need("ssm.state_size")
    config["linear_num_key_heads"] = keys.need("ssm.group_count")
    config["linear_num_value_heads"] = value_heads
    config["linear_value_head_dim"] = keys.need("ssm.inner_size") // value_heads
    rope = config["rope_parameters"]
    rotary = keys.get("rope.dimension_count") or config["head_dim"] // 4  # the 0.25 default
    rope["partial_rotary_factor"] = rotary / config["head_dim"]
    sections = keys.gguf.read_array(f"{keys.arch}.rope.dimension_sections")
    rope["mrope_section"] = ([int(s) for s in sections[:3]] if sections is not None
                             else list(QWEN35_MROPE_SECTION))  # fmt: skip
    rope["mrope_interleaved"] = True  # llama.cpp's qwen35 always interleaves them


_FAMILY: dict[str, Callable[[dict[str, Any], _Keys, set[str]], None]] = {
    "qwen3": _qwen3, "smollm3": _smollm3, "gemma3": _gemma3, "phi3": _phi3, "qwen35": _qwen35,
    "qwen3moe": _qwen3moe, "gpt-oss": _gpt_oss,
}  # fmt: skip


def _vocab_size(gguf: GGUFFile, keys: _Keys) -> int:
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, ArrayInfo):
        return tokens.count
    size = keys.get("vocab_size")
    if size is None:
        raise ModelFileError(f"{gguf.path}: neither a vocabulary nor {keys.arch}.vocab_size")
    return size


def _rope_parameters(keys: _Keys) -> dict[str, Any]:
    """transformers 5's `rope_parameters` from `{arch}.rope.freq_base` and `.rope.scaling.*`
    (Llama 3's are a tensor: `_llama3_rope`)."""
    rope: dict[str, Any] = {"rope_theta": float(keys.get("rope.freq_base", 10000.0)),
                            "rope_type": "default"}  # fmt: skip
    kind = keys.get("rope.scaling.type")
    factor = keys.get("rope.scaling.factor")
    if kind in _ROPE_SCALING_TYPES and (factor or kind == "longrope"):
        rope["rope_type"] = kind
        if factor:
            rope["factor"] = float(factor)
        original = keys.get("rope.scaling.original_context_length")
        if kind == "yarn" and original:
            rope["original_max_position_embeddings"] = original
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                          ("yarn_ext_factor", "extrapolation_factor"),
                          ("yarn_attn_factor", "attention_factor"),
                          ("attn_factor", "attention_factor")):  # fmt: skip
            value = keys.get(f"rope.scaling.{key}")
            if value is not None:
                rope[name] = float(value)
    return rope


# The llama3 rope parameters of every released Llama 3.x (factor: the file's largest)
_LLAMA3_FREQ_FACTORS = (1.0, 4.0)  # low_freq_factor, high_freq_factor
_LLAMA3_ORIGINAL_CONTEXTS = (8192, 4096, 16384, 32768, 131072)


def _llama3_rope(gguf: GGUFFile, rope: dict[str, Any], rotary: int) -> dict[str, Any]:
    """Llama 3.1+'s "llama3" rope: the converter writes its per-frequency factors as the
    tensor `rope_freqs.weight` and not its parameters. The parameters that give exactly
    those factors (convert_hf_to_gguf's formula); the rope as it is when none do."""
    factors = _float_values(gguf, "rope_freqs.weight")
    if not factors or 2 * len(factors) != rotary:
        return rope
    base, factor = rope["rope_theta"], max(factors)
    low, high = _LLAMA3_FREQ_FACTORS
    for original in _LLAMA3_ORIGINAL_CONTEXTS:
        expected = []
        for i in range(len(factors)):
            wavelength = 2 * math.pi * base ** (2 * i / rotary)
            if wavelength < original / high:
                expected.append(1.0)
            elif wavelength > original / low:
                expected.append(factor)
            else:
                smooth = (original / wavelength - low) / (high - low)
                expected.append(1 / ((1 - smooth) / factor + smooth))
        if all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(factors, expected, strict=True)):
            return {**rope, "rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": original}  # fmt: skip
    return rope


def _token_ids(gguf: GGUFFile) -> dict[str, int | None]:
    get = gguf.metadata.get
    return {"bos_token_id": get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": get("tokenizer.ggml.padding_token_id"),
            "unk_token_id": get("tokenizer.ggml.unknown_token_id")}  # fmt: skip


def generation_config(config: dict[str, Any], eos_ids: list[int] | None = None) -> dict[str, Any]:
    """generation_config.json as transformers' `GenerationConfig.from_model_config` writes
    it from this config (its token ids), with ``eos_ids`` (the ids that end generation, when
    there are more than the config's eos: a chat model's end of turn) as its eos."""
    names = ("bos_token_id", "eos_token_id", "pad_token_id")
    generation = {"_from_model_config": True,
                  **{name: config[name] for name in names if config.get(name) is not None}}  # fmt: skip
    if eos_ids and eos_ids != [config.get("eos_token_id")]:
        generation["eos_token_id"] = list(eos_ids)
    return generation
