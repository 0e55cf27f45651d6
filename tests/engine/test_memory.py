"""Memory that grew with the variety of prompt lengths (issue 29, item 4): bounded matmul
shape caches, and glibc's malloc_trim when the server's engine goes idle."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from engine import memory

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_malloc_trim_is_found_on_glibc() -> None:
    assert memory._malloc_trim() is not None


def test_release_free_memory_answers_a_bool() -> None:
    assert isinstance(memory.release_free_memory(), bool)


CHECK = """
import os
import engine
print(os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"), os.environ.get("LRU_CACHE_CAPACITY"))
"""


def test_importing_engine_bounds_the_matmul_shape_caches() -> None:
    # Without the bounds, every new prompt length grew RSS (issue 29, item 4).
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}  # fmt: skip
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["64", "64"]


def test_a_users_cache_setting_wins() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LRU_CACHE_CAPACITY": "7"}
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[1] == "7"
