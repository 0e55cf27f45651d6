"""The tensor types each of `llama-quantize`'s recipes (Q2_K, Q3_K_M, IQ4_XS, IQ2_M...) put in
a file, recorded for the tests: `tests/engine/test_gguf_recipes.py` writes GGUFs of the same
mixes without llama.cpp (CI has none) and serves them.

    .venv/bin/python -m bench.gguf_recipes --out tests/data/gguf_recipes.json \\
        smol=/tmp/recipes/smol.*.gguf 1b=/tmp/recipes/1b.*.gguf

Each argument is ``MODEL=FILES`` (a glob); a file's recipe is the part of its name after the
model's prefix (``smol.Q3_K_M.gguf``: Q3_K_M). A recipe's table maps each tensor role
(``token_embd``, ``output``, ``attn_q``... with ``blk.N.`` dropped) to its type, or to the
list of its types by layer where the recipe gives layers different types (Q3_K_M's
``attn_v``, for one). How the files were made is in docs/gguf.md ("Every recipe").
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

from engine.gguf_file import GGUFFile


def recipe_table(path: Path) -> dict[str, str | list[str]]:
    """role -> type, or role -> [type of layer 0, layer 1, ...]."""
    by_role: dict[str, dict[int, str]] = {}
    for info in GGUFFile(path).tensors:
        name = info.name.removesuffix(".weight")
        if name.endswith(".bias") or name.endswith("_norm"):
            continue  # float32 in every recipe
        layer, role = -1, name
        if name.startswith("blk."):
            index, _, role = name.removeprefix("blk.").partition(".")
            layer = int(index)
        by_role.setdefault(role, {})[layer] = info.type.name
    table: dict[str, str | list[str]] = {}
    for role, layers in sorted(by_role.items()):
        types = [layers[i] for i in sorted(layers)]
        table[role] = types[0] if len(set(types)) == 1 else types
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("models", nargs="+", help="MODEL=GLOB of its recipe files")
    args = parser.parse_args(argv)
    tables: dict[str, dict[str, dict]] = {}
    for spec in args.models:
        model, _, pattern = spec.partition("=")
        for file in sorted(glob.glob(pattern)):
            recipe = Path(file).name.removeprefix(f"{model}.").removesuffix(".gguf")
            tables.setdefault(model, {})[recipe] = recipe_table(Path(file))
    args.out.write_text(_dump(tables))
    return 0


def _dump(tables: dict[str, dict[str, dict]]) -> str:
    """JSON with a role's table on one line (a file a reviewer can read)."""
    lines = ["{"]
    for m, (model, recipes) in enumerate(tables.items()):
        lines.append(f" {json.dumps(model)}: {{")
        for r, (recipe, table) in enumerate(recipes.items()):
            lines.append(f"  {json.dumps(recipe)}: {{")
            roles = [f"   {json.dumps(role)}: {json.dumps(t)}" for role, t in table.items()]
            lines.append(",\n".join(roles))
            lines.append("  }" + ("," if r < len(recipes) - 1 else ""))
        lines.append(" }" + ("," if m < len(tables) - 1 else ""))
    return "\n".join([*lines, "}"]) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
