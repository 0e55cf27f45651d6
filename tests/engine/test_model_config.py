"""engine/model_config.py reads config.json itself: the engine must see the same model
through it as through transformers' `AutoConfig`, and the serving path must not import
transformers' model code (the import is what the reader exists to skip)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoTokenizer,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)

from engine.errors import ModelFileError
from engine.execution_plan import ModelShape
from engine.loader import load_hf_config, load_tokenizer
from engine.model_config import (
    DEFAULT_ROPE_THETA,
    DEFAULTS,
    FIELD_TYPES,
    ModelConfig,
    read_model_config,
)
from engine.models import get_model_class
from engine.models.rotary import rope_inv_freq
from engine.resolved_config import context_limit
from tests.engine.test_llama import _configs
from tests.engine.tiny_models import default_model_dir, make_tiny_model_dir

CLASSES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig,
           "qwen3": Qwen3Config, "gemma3_text": Gemma3TextConfig, "smollm3": SmolLM3Config,
           "phi3": Phi3Config, "qwen3_5_text": Qwen3_5TextConfig,
           "qwen3_moe": Qwen3MoeConfig, "gpt_oss": GptOssConfig}  # fmt: skip
# Qwen3.5's every fourth layer is full attention: four layers, or none would be.
MINIMAL = {"qwen3_5_text": {"num_hidden_layers": 4}}
# 32 heads: the key/value head counts the classes default to (32, 8) divide it.
SIZES = {"vocab_size": 1000, "hidden_size": 128, "intermediate_size": 112,
         "num_hidden_layers": 2, "num_attention_heads": 32}  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(CLASSES))
def test_the_defaults_are_those_of_transformers_classes(model_type):
    parameters = inspect.signature(CLASSES[model_type].__init__).parameters
    taken = {name for name in FIELD_TYPES if name in parameters} - {"architectures", "rope_theta"}
    assert set(DEFAULTS[model_type]) == taken
    for name, value in DEFAULTS[model_type].items():
        assert parameters[name].default == value, name


@pytest.mark.parametrize("model_type", sorted(CLASSES))
def test_the_default_rope_base_is_that_of_transformers_classes(model_type):
    theirs = getattr(CLASSES[model_type], "default_theta", 10_000.0)
    assert DEFAULT_ROPE_THETA.get(model_type, 10_000.0) == theirs


def _written(tmp_path: Path, name: str, data: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def _variants(tmp_path: Path) -> dict[str, Path]:
    """Config files as transformers writes them (every field), and as older or
    hand-written ones are (only the sizes; a legacy rope_scaling beside rope_theta)."""
    variants = {}
    for name, config in _configs().items():
        folder = tmp_path / name
        config.save_pretrained(folder)
        variants[name] = folder
    for model_type in CLASSES:
        minimal = {"model_type": model_type, **SIZES, **MINIMAL.get(model_type, {})}
        variants[f"{model_type}-minimal"] = _written(tmp_path, f"{model_type}-min", minimal)
    legacy = {"model_type": "llama", **SIZES, "rope_theta": 50000.0,
              "rope_scaling": {"type": "linear", "factor": 4.0}}  # fmt: skip
    variants["llama-legacy-rope"] = _written(tmp_path, "legacy", legacy)
    windowed = {"model_type": "qwen2", **SIZES, "use_sliding_window": True, "sliding_window": 64}
    variants["qwen2-windowed"] = _written(tmp_path, "windowed", windowed)
    return {**variants, **_family_variants(tmp_path)}


def _family_variants(tmp_path: Path) -> dict[str, Path]:
    """The families of issue 62 as older config.json files write them (the fields
    transformers' classes convert or derive)."""
    configs = {
        "qwen3-windowed": {"model_type": "qwen3", "use_sliding_window": True,
                           "sliding_window": 64, "max_window_layers": 1},
        "gemma3-legacy": {"model_type": "gemma3_text", "rope_theta": 500000.0,
                          "rope_local_base_freq": 20000.0, "sliding_window_pattern": 2,
                          "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                          "query_pre_attn_scalar": 144, "final_logit_softcapping": 30.0},
        "smollm3-nope": {"model_type": "smollm3", "no_rope_layers": [0, 1],
                         "rope_theta": 5000000.0},
        "phi4-mini-like": {"model_type": "phi3", "partial_rotary_factor": 0.75,
                           "max_position_embeddings": 131072,
                           "original_max_position_embeddings": 4096,
                           "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 6,
                                            "long_factor": [2.0] * 6}},
    }  # fmt: skip
    sizes = {**SIZES, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16}  # fmt: skip
    return {name: _written(tmp_path, name, {**sizes, **config}) for name, config in configs.items()}


def _what_the_engine_reads(config) -> tuple:
    cls = get_model_class(config)
    arch = cls.architecture(config)
    kinds = sorted({arch.rope_of(i) for i in range(arch.num_layers)} - {"none"})
    tables = [rope_inv_freq(config, arch.head_dim, None if k == "default" else k) for k in kinds]
    inv_freq = torch.cat([t[0] for t in tables])
    scaling = [t[1] for t in tables]
    return arch, ModelShape.of(config), context_limit(config), inv_freq, scaling


def test_the_engine_reads_the_same_model_from_either_config(tmp_path):
    variants = _variants(tmp_path)
    assert len(variants) >= 11
    for name, folder in variants.items():
        ours = read_model_config(folder)
        theirs = AutoConfig.from_pretrained(folder, local_files_only=True)
        assert isinstance(ours, ModelConfig)
        mine, reference = _what_the_engine_reads(ours), _what_the_engine_reads(theirs)
        assert mine[:3] == reference[:3], name
        assert torch.equal(mine[3], reference[3]) and mine[4] == reference[4], name


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_hidden_layers", True), ("hidden_size", 64.0), ("rms_norm_eps", "small"),
     ("rope_parameters", [1]), ("tie_word_embeddings", 1)],
)  # fmt: skip
def test_a_field_of_the_wrong_type_is_one_line_naming_it(tmp_path, field, value):
    folder = _written(tmp_path, "m", {"model_type": "llama", **SIZES, field: value})
    with pytest.raises(ModelFileError, match=f"cannot read its config.json \\({field} is "):
        read_model_config(folder)


@pytest.mark.parametrize(
    "text",
    ["[" * 100_000, '{"model_type": "llama", ', "[]", '{"vocab_size": 1e999999}'],
    ids=["nested 100,000 deep", "cut short", "not an object", "a number past float"],
)
def test_a_config_json_that_is_not_one_is_one_line(tmp_path, text):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(text)
    with pytest.raises(ModelFileError, match="cannot read its config.json"):
        read_model_config(folder)


def test_a_side_file_nested_past_the_parser_reads_as_absent(tmp_path):
    # load_tokenizer reads tokenizer_config.json, source_gguf pagedserve_source.json, through
    # the same reader: a file it cannot parse is no file (a RecursionError escaped it).
    from engine.loader import SOURCE_FILE, source_gguf

    (tmp_path / SOURCE_FILE).write_text("[" * 100_000)
    assert source_gguf(tmp_path) is None


def test_the_tokenizer_is_the_one_autotokenizer_chooses(tmp_path):
    """A Hugging Face directory's tokenizer is AutoTokenizer's class; a GGUF's is built from
    the file without transformers (engine/gguf_fast_tokenizer.py) and encodes alike."""
    hf_dir = make_tiny_model_dir(tmp_path / "hf")
    assert type(load_tokenizer(hf_dir)) is type(AutoTokenizer.from_pretrained(hf_dir))
    folder = default_model_dir()
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(ours).__module__ == "engine.gguf_fast_tokenizer"
    text = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.chat_template == theirs.chat_template


def test_loading_the_config_and_tokenizer_imports_no_model_code():
    # transformers 5's configuration modules import torch.distributed.tensor and sympy:
    # seconds of every start, for nothing the server uses.
    script = (
        "import sys\n"
        "from engine.loader import load_hf_config, load_tokenizer\n"
        f"folder = {str(default_model_dir())!r}\n"
        "load_hf_config(folder); load_tokenizer(folder)\n"
        "heavy = ('sympy', 'torch.distributed.tensor', 'transformers.models.llama')\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    assert run.stdout.strip() == "[]", run.stdout


def test_load_hf_config_still_refuses_an_architecture_it_lacks(tmp_path):
    folder = _written(
        tmp_path, "gpt2", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    )
    with pytest.raises(ValueError, match="unsupported model architecture GPT2LMHeadModel"):
        load_hf_config(folder)
