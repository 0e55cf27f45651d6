"""kv_cache and scheduler are pure Python: importing them loads no torch and
no transformers (checked in a fresh interpreter, where nothing else could
have imported them first)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHECK = """
import sys
import kv_cache
import scheduler
from kv_cache import KVCacheManager
loaded = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(",".join(loaded) or "clean")
"""


def test_kv_cache_and_scheduler_import_no_torch() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "clean"
