"""Suite-wide set-up: an offline, repo-local model cache shared by every test run."""

from __future__ import annotations

import os
from pathlib import Path

# The default model's GGUF is converted once into this cache; a fresh clone pays
# the conversion in its first run only.
os.environ.setdefault("PAGEDSERVE_CACHE", str(Path(__file__).resolve().parent.parent / ".cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Before any test imports torch: see engine/__init__.py.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_sessionstart(session) -> None:
    """Convert the embedded default model before any test starts a server with a deadline.

    A fresh clone has an empty cache; the conversion (30-90 s on a busy 2-core machine)
    would otherwise happen inside whichever test first needs the tokenizer.
    """
    from engine.loader import resolve_model_dir

    resolve_model_dir(None)
