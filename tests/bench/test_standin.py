"""bench.standin: a Llama-shaped directory of the named shape, random weights, the project's
tokenizer, which transformers loads as that model (llama.cpp's tools are not run here)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from bench import standin
from engine.loader import load_tokenizer
from tests.engine.tiny_models import default_tokenizer

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip


def test_a_standin_directory_is_the_named_shape_with_random_weights(monkeypatch, tmp_path):
    monkeypatch.setitem(standin.SHAPES, "tiny", TINY)
    path = standin.write_hf_dir("tiny", tmp_path / "tiny", seed=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, 49152)
    q = model.model.layers[1].self_attn.q_proj.weight
    assert q.shape == (64, 64) and 0.015 < q.std().item() < 0.025  # random, std 0.02
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    text = "a stand-in speaks the project's tokenizer"
    assert load_tokenizer(path).encode(text) == default_tokenizer().encode(text)
    again = standin.write_hf_dir("tiny", tmp_path / "again", seed=1)
    same = AutoModelForCausalLM.from_pretrained(again, dtype=torch.float32)
    assert torch.equal(same.model.layers[1].self_attn.q_proj.weight, q)


def test_the_named_shapes_are_the_models_they_stand_in_for():
    assert standin.SHAPES["8b"]["hidden_size"] == 4096
    assert standin.SHAPES["8b"]["intermediate_size"] == 14336
    assert standin.SHAPES["1b"]["num_hidden_layers"] == 22
