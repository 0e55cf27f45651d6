"""A GGUF's config, tokenizer and chat template come from the file's own metadata
(engine/gguf_config.py, engine/gguf_tokenizer.py), never through transformers' GGUF reader:
tiny random models of each family written as llama.cpp's converter writes them give the
config transformers holds for the same model, its weights under transformers' names, the
tokenizer transformers' GGUF reader builds (the same ids), and their chat template; and
serving the default GGUF imports no transformers module at all."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from functools import lru_cache

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.gguf_weights import GGUFTensor
from engine.loader import convert_gguf, iter_weights, load_generation_eos, load_tokenizer
from engine.model_config import FIELD_TYPES, read_model_config
from tests.engine.gguf_models import bpe_vocab, spm_vocab, write_family_gguf
from tests.engine.test_loader import default_tokenizer
from tests.engine.tiny_models import REPO_ROOT

TEMPLATE = ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}"
            "<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}{{ bos_token }}")  # fmt: skip
SHAPE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 96, "max_position_embeddings": 512, "rms_norm_eps": 1e-6}  # fmt: skip
# model_type -> (its config beyond SHAPE, the vocabulary kind, pre-tokenizer name)
FAMILIES = {
    "llama": ({"num_hidden_layers": 2, "head_dim": 16, "tie_word_embeddings": True,
               "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}, "bpe",
              "smollm"),
    # Llama 3.1+: its rope's parameters only as the converter's rope_freqs tensor
    "llama3": ({"model_type": "llama", "num_hidden_layers": 2, "head_dim": 64,
                "num_attention_heads": 1, "num_key_value_heads": 1,
                "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                    "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}}, "bpe",
               "llama-bpe"),
    # a SentencePiece vocabulary under arch llama (Mistral 7B, Llama 2): the prefix space
    "mistral": ({"num_hidden_layers": 2, "sliding_window": None,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "spm",
                None),
    "qwen3": ({"num_hidden_layers": 2, "head_dim": 24, "tie_word_embeddings": True,
               "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}, "bpe",
              "qwen2"),
    "smollm3": ({"num_hidden_layers": 4, "rope_parameters": {"rope_type": "default",
                                                             "rope_theta": 5000000.0}},
                "bpe", "llama-bpe"),
    # 7 layers: the pattern's sixth is global, the seventh slides again
    "gemma3_text": ({"num_hidden_layers": 7, "head_dim": 16, "query_pre_attn_scalar": 16,
                     "sliding_window": 32, "final_logit_softcapping": 30.0,
                     "rope_parameters": {
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
                    "spm", None),
    "phi3": ({"num_hidden_layers": 2, "original_max_position_embeddings": 128,
              "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.75,
                                  "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                  "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
                                  "original_max_position_embeddings": 128}}, "spm", None),
}  # fmt: skip
# Fields of the families' configs the engine reads beside FIELD_TYPES
FAMILY_FIELDS = ("layer_types", "query_pre_attn_scalar", "hidden_activation",
                 "final_logit_softcapping", "no_rope_layers", "no_rope_layer_interval",
                 "original_max_position_embeddings", "bos_token_id", "eos_token_id")  # fmt: skip
CORPUS = [
    "Hello, world! The café costs 3.50€.\n  Indented line.",
    "12345 678 9 0.001 1e10 3,141,592 ２０２６年 v1.2.3",
    "   leading spaces\t\ttabs\n\n\nnewlines   trailing   ",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tif x != None: pass",
    "Emoji 🚀🦙 ✅ naïve façade Ελληνικά русский 中文 日本語 한국어 العربية",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it",
    "\u00a0non-breaking\u200bzero width\r\nCRLF and the end",
    "a",
    " ",
    "  two",
    "",
]


@lru_cache(maxsize=8)
def family_gguf(model_type: str, tmp_root: str) -> tuple:
    """(the GGUF, its converted directory, transformers' model) of a tiny family model."""
    from pathlib import Path

    extra, kind, pre = FAMILIES[model_type]
    vocab = bpe_vocab(pre) if kind == "bpe" else spm_vocab()
    extra = dict(extra)
    config = AutoConfig.for_model(extra.pop("model_type", model_type), **{**SHAPE, **extra},
                                  vocab_size=len(vocab["tokens"]),
                                  bos_token_id=vocab["bos"], eos_token_id=vocab["eos"],
                                  pad_token_id=vocab["pad"])  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms: an identity norm would hide a wrong offset
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
    root = Path(tmp_root)
    path = write_family_gguf(root / f"{model_type}.gguf", model, vocab, TEMPLATE)
    return path, convert_gguf(path, root / "cache"), model


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("families"))


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_config_is_transformers_config_of_the_same_model(model_type, tmp_root):
    _, model_dir, model = family_gguf(model_type, tmp_root)
    config, reference = read_model_config(model_dir), model.config
    assert config.architectures == reference.architectures or config.architectures == [
        type(model).__name__
    ]
    compared = 0
    for field in (*FIELD_TYPES, *FAMILY_FIELDS):
        if field in ("architectures", "rope_scaling") or not hasattr(reference, field):
            continue
        expected = getattr(reference, field)
        if field == "rope_parameters":  # what transformers adds on its side
            expected = _without(expected, ("attention_factor",))
        assert _f32(getattr(config, field, None)) == _f32(expected), field
        compared += 1
    assert compared >= 14


def _f32(value):
    """Numbers as float32 (a GGUF stores eps, rope bases and factors in float32)."""
    if isinstance(value, float):
        return float(np.float32(value))
    if isinstance(value, dict):
        return {k: _f32(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_f32(v) for v in value]
    return value


def _without(value, keys):
    if isinstance(value, dict):
        return {k: _without(v, keys) for k, v in value.items() if k not in keys}
    return value


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_weights_are_transformers_names_and_values(model_type, tmp_root):
    _, model_dir, model = family_gguf(model_type, tmp_root)
    reference = model.state_dict()
    weights = dict(iter_weights(model_dir))
    tied = model.config.tie_word_embeddings
    assert weights.keys() == reference.keys() - ({"lm_head.weight"} if tied else set())
    for name, weight in weights.items():  # q/k rows un-permuted, Gemma's norms less one
        dense = weight.dequantize() if isinstance(weight, GGUFTensor) else weight
        assert torch.allclose(dense, reference[name], rtol=0, atol=1e-7), name


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3", "gemma3_text", "phi3"])
def test_tokenizer_ids_equal_transformers_gguf_tokenizer(model_type, tmp_root):
    # (smollm3: transformers' GGUF reader refuses the architecture)
    path, model_dir, _ = family_gguf(model_type, tmp_root)
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = load_tokenizer(model_dir)
    specials = [t for t in ("<|im_start|>", "<|im_end|>", "<start_of_turn>", "<bos>", "<eos>")
                if t in tokenizer.get_vocab()]  # fmt: skip
    texts = [*CORPUS, " ".join(specials) + " user\nHi" + "".join(specials)]
    for text in texts:
        for special in (True, False):
            ids = tokenizer.encode(text, add_special_tokens=special)
            assert ids == reference.encode(text, add_special_tokens=special), (text, special)
        ids = reference.encode(text)
        assert tokenizer.decode(ids) == reference.decode(ids), text
        skipped = tokenizer.decode(ids, skip_special_tokens=True)
        assert skipped == reference.decode(ids, skip_special_tokens=True), text
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        reference.bos_token_id, reference.eos_token_id, reference.pad_token_id)  # fmt: skip
    assert tokenizer.chat_template == reference.chat_template == TEMPLATE
    chat = [{"role": "user", "content": 'Hi "there" ü'}, {"role": "assistant", "content": ""}]
    tools = [{"type": "function", "function": {"name": "f", "description": "<ü>"}}]
    rendered = tokenizer.apply_chat_template(chat, tools, add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
    assert rendered == reference.apply_chat_template(chat, tools, add_generation_prompt=True,
                                                     tokenize=False)  # fmt: skip


def test_every_pre_tokenizer_split_is_the_one_transformers_gguf_reader_uses():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from engine.gguf_tokenizer import SPLIT_REGEXES

    assert {name: GGUF_PRE_TOKENIZER_SPLITS[name] for name in SPLIT_REGEXES} == SPLIT_REGEXES


def test_default_model_tokens_and_chat_equal_transformers_gguf_reader():
    from engine.loader import default_gguf_path

    gguf = default_gguf_path()
    reference = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = default_tokenizer()
    for text in [*CORPUS, "<|im_start|>user\nWhat?<|im_end|>\n<|im_start|>assistant\n",
                 "<|endoftext|><repo_name>x<file_sep> <|im_end|>text"]:  # fmt: skip
        assert tokenizer.encode(text) == reference.encode(text), text
    for system in ([], [{"role": "system", "content": "Be brief."}]):
        chat = [*system, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
        for prompt in (True, False):
            ours = tokenizer.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
            theirs = reference.apply_chat_template(chat, add_generation_prompt=prompt,
                                                   tokenize=False)  # fmt: skip
            assert ours == theirs


@pytest.mark.parametrize("model_type", ["llama3", "qwen3", "smollm3", "gemma3_text", "phi3"])
def test_a_family_gguf_serves_transformers_greedy_tokens(model_type, tmp_root):
    # the converter's file of the model, served float32: the tokens transformers generates
    from engine import LLM, SamplingParams

    path, _, model = family_gguf(model_type, tmp_root)
    prompt = [5, 17, 300, 42, 99, 7, 250, 11]
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                             do_sample=False)[0, len(prompt):].tolist()  # fmt: skip
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, cache_dir=f"{tmp_root}/cache")
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert out[0].token_ids == ids


def test_a_chat_models_end_of_turn_ends_generation(tmp_root):
    # Gemma 3's file names <eos> as eos; its turns end with <end_of_turn>, where llama.cpp
    # (and Gemma's own generation_config.json) stop too
    _, model_dir, _ = family_gguf("gemma3_text", tmp_root)
    tokenizer = load_tokenizer(model_dir)
    assert load_generation_eos(model_dir) == {1, tokenizer.convert_tokens_to_ids("<end_of_turn>")}
    _, model_dir, _ = family_gguf("llama", tmp_root)  # SmolLM2's vocabulary: <|im_end|> alone
    assert load_generation_eos(model_dir) == {2}


def test_what_the_metadata_cannot_say_is_one_line_naming_the_file(tmp_path, tmp_root):
    from engine.errors import ModelFileError

    _, _, model = family_gguf("qwen3", tmp_root)
    kinds = {"bert": "tokenizer kind 'bert'", "gpt2": "token types for"}
    for kind, message in kinds.items():
        vocab = {**bpe_vocab("qwen2"), "model": kind}
        vocab["types"] = vocab["types"][: -1 if kind == "gpt2" else None]
        path = write_family_gguf(tmp_path / f"{kind}.gguf", model, vocab)
        with pytest.raises(ModelFileError, match=message) as refused:
            convert_gguf(path, tmp_path / "cache")
        assert str(path) in str(refused.value) and "\n" not in str(refused.value)
    assert not list((tmp_path / "cache" / "models").iterdir())  # nothing cached


def test_a_template_is_rendered_in_a_sandbox(tmp_root):
    _, model_dir, _ = family_gguf("llama", tmp_root)
    tokenizer = load_tokenizer(model_dir)
    hostile = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(Exception, match="unsafe|attribute"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], chat_template=hostile,
                                      tokenize=False)  # fmt: skip
    refusing = "{{ raise_exception('no system role') }}"
    with pytest.raises(Exception, match="no system role"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}],
                                      chat_template=refusing, tokenize=False)  # fmt: skip


NO_TRANSFORMERS = textwrap.dedent("""
    import json, sys
    from engine import LLM, SamplingParams
    llm = LLM(dtype="float32", max_model_len=256)
    prompt = llm.apply_chat_template([{"role": "user", "content": "Hi"}])
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))[0]
    print(json.dumps({"text": out.text, "ids": out.token_ids,
                      "transformers": sorted(m for m in sys.modules if m.startswith("transformers"))}))
""")


def test_serving_a_gguf_imports_no_transformers_module(tmp_path):
    # A fresh process: converting the default GGUF (into an empty cache), loading it,
    # rendering a chat and generating never imports transformers.
    env = {"PAGEDSERVE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}  # fmt: skip
    run = subprocess.run([sys.executable, "-c", NO_TRANSFORMERS], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=240)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["transformers"] == []
    assert len(result["ids"]) == 2
