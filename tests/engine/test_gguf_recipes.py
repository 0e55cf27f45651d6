"""Every recipe `llama-quantize` makes (issue 67: Q2_K, Q3_K_S/M/L, IQ4_XS, IQ4_NL, IQ3_M, IQ2_M,
the single i-quant types, and a per-layer mix like the "dynamic" files) is served from its
blocks: no tensor of any recipe is dequantized at load.

CI has no llama.cpp, so the recipes' tensor types are recorded from the real files
(`tests/data/gguf_recipes.json`, written by `python -m bench.gguf_recipes`; the files were
made as docs/gguf.md's "Every recipe" says): the default model's own recipe files (whose
576-wide rows make llama-quantize keep legacy types where a 256-value type does not fit) and
the 1B stand-in's (2048-wide rows: every tensor in the recipe's named types). Each default-model
recipe is written again here with its recorded types (the layers that hold all its types) and
served; each 1B recipe's types must all be ones the kernels multiply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from engine import LLM, SamplingParams
from engine.gguf_weights import NATIVE_TYPES
from engine.kernels import ggml_kernels
from tests.engine.gguf_models import write_layers_gguf

pytestmark = pytest.mark.skipif(ggml_kernels() is None, reason="the GGUF kernels need AVX2")
RECIPES = json.loads((Path(__file__).parents[1] / "data" / "gguf_recipes.json").read_text())
NATIVE = {t.name for t in NATIVE_TYPES}
FLOAT = {"F32"}  # norms and biases (dropped from the tables) and any float32 tensor


def _layer_types(table: dict, layer: int) -> dict[str, T]:
    """Layer ``layer``'s projection types: role -> type."""
    return {role: T[types if isinstance(types, str) else types[layer]]
            for role, types in table.items() if role not in ("token_embd", "output")}  # fmt: skip


def _covering_layers(table: dict, layers: int) -> list[int]:
    """Layers whose projections hold every type the recipe gives them: layer 0, then each
    layer that adds a type not yet held."""
    held: set[T] = set()
    chosen = []
    for layer in range(layers):
        types = set(_layer_types(table, layer).values())
        if not chosen or types - held:
            chosen.append(layer)
            held |= types
    return chosen


@pytest.mark.parametrize(
    ("model", "recipe"), [(m, r) for m, recipes in RECIPES.items() for r in recipes]
)
def test_every_recorded_recipe_holds_only_types_the_kernels_multiply(model, recipe):
    table = RECIPES[model][recipe]
    types = {t for value in table.values() for t in ([value] if isinstance(value, str) else value)}
    assert types - FLOAT <= NATIVE, (model, recipe, sorted(types - FLOAT - NATIVE))


def _distinct(tables: dict[str, dict]) -> dict[str, dict]:
    """One table per distinct mix, named by every recipe that makes it (on the default
    model's shapes Q2_K and Q3_K_S give the same file)."""
    names: dict[str, list[str]] = {}
    for recipe, table in sorted(tables.items()):
        names.setdefault(json.dumps(table, sort_keys=True), []).append(recipe)
    return {"=".join(recipes): json.loads(key) for key, recipes in names.items()}


SMOL = _distinct(RECIPES["smol"])


@pytest.mark.parametrize("recipe", sorted(SMOL))
def test_each_default_model_recipe_serves_from_its_blocks(recipe, tmp_path):
    table = SMOL[recipe]
    layers = len(next(v for v in table.values() if isinstance(v, list))) \
        if any(isinstance(v, list) for v in table.values()) else 1  # fmt: skip
    chosen = _covering_layers(table, layers)
    path = write_layers_gguf(tmp_path / f"{recipe}.gguf",
                             tuple(_layer_types(table, i) for i in chosen),
                             embedding=T[table["token_embd"]])  # fmt: skip
    llm = LLM(model=str(path), cache_dir=str(tmp_path), num_blocks=16)
    summary = llm.engine.core.compute_summary
    assert "dequantized" not in summary, (recipe, summary)
    for i in chosen:
        for qtype in set(_layer_types(table, i).values()):
            assert f"{qtype.name} x" in summary, (recipe, qtype.name, summary)
    assert f"embedding {table['token_embd']}" in summary, summary
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].token_ids) == 4
