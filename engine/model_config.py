"""A model's config.json, read without importing transformers' model code.

transformers 5's `AutoConfig` imports the architecture's configuration module, which
imports torch.distributed.tensor and sympy: on a 2-core Zen 3 that was more than half of a
warm start of the server (`bench/startup.py`). The engine reads a score of plain JSON
fields (`FIELD_TYPES`), so it reads the file itself and fills what a file leaves out with
the default of transformers' class for its model_type (`DEFAULTS`, held to transformers'
classes by tests/engine/test_model_config.py). Where transformers' own object is needed
(a rope scaling other than the default, whose frequencies transformers computes),
`transformers_config()` builds it then.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from engine.errors import ModelFileError

_INT, _NUMBER, _NONE = (int,), (int, float), (type(None),)

# The fields the engine reads, and the JSON types each may hold (None: "not set").
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "model_type": (str,),
    "architectures": (list, *_NONE),
    "vocab_size": _INT,
    "hidden_size": _INT,
    "intermediate_size": _INT,
    "num_hidden_layers": _INT,
    "num_attention_heads": _INT,
    "num_key_value_heads": (*_INT, *_NONE),
    "head_dim": (*_INT, *_NONE),
    "hidden_act": (str,),
    "max_position_embeddings": _INT,
    "rms_norm_eps": _NUMBER,
    "tie_word_embeddings": (bool,),
    "attention_bias": (bool,),
    "mlp_bias": (bool,),
    "rope_theta": _NUMBER,
    "rope_parameters": (dict, *_NONE),
    "rope_scaling": (dict, *_NONE),
    "partial_rotary_factor": _NUMBER,
    "sliding_window": (*_INT, *_NONE),
    "use_sliding_window": (bool,),
    "layer_types": (list, *_NONE),
    "max_window_layers": _INT,
    "hidden_activation": (str,),
    "query_pre_attn_scalar": _NUMBER,
    "final_logit_softcapping": (*_NUMBER, *_NONE),
    "attn_logit_softcapping": (*_NUMBER, *_NONE),
    "use_bidirectional_attention": (bool, *_NONE),
    "rope_local_base_freq": _NUMBER,
    "sliding_window_pattern": _INT,
    "no_rope_layers": (list, *_NONE),
    "no_rope_layer_interval": _INT,
    "original_max_position_embeddings": _INT,
    # Qwen3.5's linear-attention (Gated DeltaNet) layers
    "full_attention_interval": _INT,
    "linear_conv_kernel_dim": _INT,
    "linear_key_head_dim": _INT,
    "linear_value_head_dim": _INT,
    "linear_num_key_heads": _INT,
    "linear_num_value_heads": _INT,
    # mixtures of experts (Qwen3-MoE)
    "num_experts": _INT,
    "num_experts_per_tok": _INT,
    "moe_intermediate_size": _INT,
    "norm_topk_prob": (bool,),
    "decoder_sparse_step": _INT,
    "mlp_only_layers": (list, *_NONE),
    "num_local_experts": _INT,
    "swiglu_alpha": _NUMBER,  # gpt-oss' clamped SwiGLU
    "swiglu_limit": _NUMBER,
}
# Fields transformers writes under another name than the one it reads (its configs'
# `attribute_map`): transformers 5 saves Qwen3-MoE's `num_experts` as `num_local_experts`,
# the released checkpoints' config.json says `num_experts`.
ALIASES = {"num_local_experts": "num_experts"}

_SHARED = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "num_attention_heads": 32, "num_hidden_layers": 32, "hidden_size": 4096,
           "rope_parameters": None}  # fmt: skip
_NO_ACT = {k: v for k, v in _SHARED.items() if k != "hidden_act"}  # (Gemma: hidden_activation)

# transformers' defaults (its config classes' __init__ arguments) for the fields above,
# per model_type; a field a class does not take is absent, as it is from its object.
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_SHARED, "vocab_size": 32000, "intermediate_size": 11008,
              "num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048,
              "attention_bias": False, "mlp_bias": False},
    "qwen2": {**_SHARED, "vocab_size": 151936, "intermediate_size": 22016,
              "num_key_value_heads": 32, "max_position_embeddings": 32768,
              "sliding_window": 4096, "use_sliding_window": False, "layer_types": None,
              "max_window_layers": 28},
    "mistral": {**_SHARED, "vocab_size": 32000, "intermediate_size": 14336,
                "num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 131072,
                "sliding_window": 4096},
    "qwen3": {**_SHARED, "vocab_size": 151936, "intermediate_size": 22016,
              "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
              "attention_bias": False, "sliding_window": 4096, "use_sliding_window": False,
              "layer_types": None, "max_window_layers": 28},
    "gemma3_text": {**_NO_ACT, "vocab_size": 262208, "hidden_size": 2304,
                    "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
                    "tie_word_embeddings": True, "attention_bias": False, "sliding_window": 4096,
                    "layer_types": None, "query_pre_attn_scalar": 256,
                    "final_logit_softcapping": None, "attn_logit_softcapping": None,
                    "use_bidirectional_attention": False},
    "smollm3": {**_SHARED, "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 11008,
                "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4,
                "max_position_embeddings": 32768, "tie_word_embeddings": True,
                "attention_bias": False, "mlp_bias": False, "sliding_window": None,
                "use_sliding_window": False, "layer_types": None, "no_rope_layers": None,
                "no_rope_layer_interval": 4},
    "phi3": {**_SHARED, "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
             "num_key_value_heads": None, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
             "sliding_window": None, "original_max_position_embeddings": 4096},
    "qwen3_5_text": {**_SHARED, "vocab_size": 248320, "intermediate_size": 12288,
                     "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
                     "max_position_embeddings": 32768, "attention_bias": False,
                     "layer_types": None, "linear_conv_kernel_dim": 4,
                     "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                     "linear_num_key_heads": 16, "linear_num_value_heads": 32},
    "qwen3_moe": {**_SHARED, "vocab_size": 151936, "hidden_size": 2048,
                  "intermediate_size": 6144, "num_hidden_layers": 24, "num_key_value_heads": 4,
                  "max_position_embeddings": 32768, "attention_bias": False,
                  "sliding_window": 4096, "use_sliding_window": False, "decoder_sparse_step": 1,
                  "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
                  "norm_topk_prob": False, "mlp_only_layers": None},
    "gpt_oss": {**_SHARED, "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
                "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
                "head_dim": 64, "sliding_window": 128, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "num_experts_per_tok": 4, "num_local_experts": 128,
                "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "layer_types": None,
                "attention_bias": True},
}  # fmt: skip
# Multimodal checkpoints served as their text model: model_type -> the text model's
# architecture (its config is the file's `text_config`, its weights those under
# `model.language_model.`; `text_weight_name`).
TEXT_MODELS = {"qwen3_5": "Qwen3_5ForCausalLM"}
_TEXT_PREFIX = "model.language_model."

# The rope base a config that names none gets: transformers' class attribute `default_theta`
# where a class sets its own (Gemma 3: one for full layers, one for sliding ones).
DEFAULT_ROPE_THETA: dict[str, Any] = {
    "smollm3": 2_000_000.0, "gemma3_text": {"global": 1_000_000.0, "local": 10_000.0},
    "gpt_oss": 150_000.0,
}  # fmt: skip


# The rotating share of each head a config that names none gets, where transformers' class
# sets its own (Qwen3.5's, in its rope parameters).
DEFAULT_PARTIAL_ROTARY: dict[str, float] = {"qwen3_5_text": 0.25}
# The rope scaling a config that names none gets, where transformers' class sets one
# (gpt-oss' YaRN, in its __post_init__).
DEFAULT_ROPE_SCALING: dict[str, dict[str, Any]] = {
    "gpt_oss": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096},
}  # fmt: skip


def default_rope_theta(config: Any) -> Any:
    """The rope base of ``config``'s model_type when the config names none."""
    return DEFAULT_ROPE_THETA.get(getattr(config, "model_type", None), 10_000.0)


class ModelConfig(SimpleNamespace):
    """config.json's fields as attributes, with transformers' defaults for its model_type;
    the other keys of the file are kept as they are. Picklable (tensor-parallel workers)."""

    _name_or_path: str

    def transformers_config(self) -> Any:
        """transformers' own config object of the same directory (imports transformers'
        model code: for what only transformers computes)."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self._name_or_path, local_files_only=True)


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """The config.json of ``model_dir``; `ModelFileError` naming the file and the field for
    a file that is not JSON or a field of the wrong type. A model_type without defaults
    here keeps only its own fields (the loader then refuses the architecture)."""
    file = Path(model_dir) / "config.json"
    try:
        data = json.loads(file.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:  # (nested past the parser's depth)
        raise ModelFileError(f"{model_dir}: cannot read its config.json ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelFileError(f"{model_dir}: cannot read its config.json (not a JSON object)")
    for name, value in data.items():
        types = FIELD_TYPES.get(name)
        # bool is an int to Python, never to a config: a layer count of `true` is refused.
        wrong_bool = isinstance(value, bool) and bool not in types if types else False
        if types and (not isinstance(value, types) or wrong_bool):
            raise ModelFileError(f"{model_dir}: cannot read its config.json ({name} is "
                                 f"{value!r}, not {' or '.join(_type_names(types))})")  # fmt: skip
    data = _text_model(data)
    for alias, name in ALIASES.items():
        if alias in data and name not in data:
            data[name] = data[alias]
    data = {**DEFAULTS.get(data.get("model_type"), {}), **data}
    for alias, name in ALIASES.items():  # (a default given under the alias: gpt-oss')
        if alias in data and name not in data:
            data[name] = data[alias]
    return ModelConfig(**{**data, "_name_or_path": str(model_dir)})


def _text_model(data: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's config as its text model's (`TEXT_MODELS`); any other as
    it is."""
    architecture = TEXT_MODELS.get(data.get("model_type"))
    text = data.get("text_config")
    if architecture is None or not isinstance(text, dict):
        return data
    tie = text.get("tie_word_embeddings", data.get("tie_word_embeddings", False))
    return {**text, "architectures": [architecture], "tie_word_embeddings": tie,
            "text_model_of": data.get("model_type")}  # fmt: skip


def text_weight_name(name: str, wrapped: bool) -> str | None:
    """A checkpoint tensor's name as the model loads it: a multimodal checkpoint's text
    model's (``wrapped``) under transformers' text names, None for the rest of it (the
    vision tower, the multi-token prediction layers)."""
    if not wrapped:
        return name
    if name.startswith(_TEXT_PREFIX):
        return "model." + name[len(_TEXT_PREFIX) :]
    return name if name == "lm_head.weight" else None


def as_transformers_config(config: Any) -> Any:
    """transformers' object for a `ModelConfig`; any other config as it is."""
    return config.transformers_config() if isinstance(config, ModelConfig) else config


def _type_names(types: tuple[type, ...]) -> list[str]:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
             list: "a list", dict: "an object", type(None): "null"}  # fmt: skip
    return [names[t] for t in types]
