"""The tensor types each of `llama-quantize`'s recipes (Q2_K, Q3_K_M, IQ4_XS, IQ2_M...) put in
a file, recorded for the tests: `tests/engine/test_gguf_recipes.py` writes GGUFs of the same
mixes without llama.cpp (CI has none) and serves them.

    .venv/bin/python -m bench.gguf_recipes --out tests/data/gguf_recipes.json \\
        "smol=/tmp/recipes/smol.*.gguf" "1b=/tmp/recipes/dry1b.*.log"

Each argument is ``MODEL=FILES`` (a glob): GGUF files, or the output of `llama-quantize
--dry-run` (``.log``: the types it would write, in seconds where an IQ2 recipe of a 1B model
takes half an hour); a file's recipe is the part of its name after the first dot
(``smol.Q3_K_M.gguf``, ``dry1b.Q3_K_M.log``: Q3_K_M). A recipe's table maps each tensor role
(``token_embd``, ``output``, ``attn_q``... with ``blk.N.`` dropped) to its type, or to the
list of its types by layer where the recipe gives layers different types (Q3_K_M's
``attn_v``, for one). How the files were made is in docs/gguf.md ("Every recipe").
"""

from __future__ import annotations

import argparse
import glob
import json
import re
from pathlib import Path

from engine.gguf_file import GGUFFile

# A tensor's line in `llama-quantize --dry-run`'s output: its name, its type in the source, and
# the type it would be written in (absent where it stays as it is).
_DRY_RUN_LINE = re.compile(r"\]\s+(\S+)\s+- \[.*?\], type =\s+(\w+),.*?(?:\((\w+)\))?$")


def tensor_types(path: Path) -> list[tuple[str, str]]:
    """(name, type) of each tensor of a GGUF, or of a `llama-quantize --dry-run` log."""
    if path.suffix != ".log":
        return [(info.name, info.type.name) for info in GGUFFile(path).tensors]
    found = []
    for line in path.read_text().splitlines():
        if (match := _DRY_RUN_LINE.search(line)) is not None:
            name, source, written = match.groups()
            found.append((name, (written or source).upper()))
    return found


def recipe_table(path: Path) -> dict[str, str | list[str]]:
    """role -> type, or role -> [type of layer 0, layer 1, ...]."""
    by_role: dict[str, dict[int, str]] = {}
    for tensor, qtype in tensor_types(path):
        name = tensor.removesuffix(".weight")
        if name.endswith(".bias") or name.endswith("_norm"):
            continue  # float32 in every recipe
        layer, role = -1, name
        if name.startswith("blk."):
            index, _, role = name.removeprefix("blk.").partition(".")
            layer = int(index)
        by_role.setdefault(role, {})[layer] = qtype
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
            recipe = Path(file).name.split(".", 1)[1].rsplit(".", 1)[0]
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
