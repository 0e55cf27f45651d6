"""The default tokenizer's files, copied into a stand-in's directory (bench/standin.py,
bench/standin_gpt_oss.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)  # (transformers 5 keeps the template apart)


def copy_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    """Each of `TOKENIZER_FILES` that `tokenizer_dir` has, into `out`."""
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
