"""Pack what a bare GPU host lacks into .gpu/, for bench/gpu_run.sh to use there.

    .venv/bin/python -m bench.gpu_pack

Run it on a machine that reaches PyPI. The GPU hosts this project is lent have python
3.12 with torch, triton, transformers, numpy, httpx, pytest, hypothesis and pytest-xdist
(/work/.library/device/KINDS.md lists them) and can reach nothing: the server's own
packages travel as wheels, with the checkout, in at most 64 MiB all told. This downloads
the CPython 3.12 manylinux wheels of `ROOTS` and what they need, at the versions this venv has (so both
ends run what the tests ran), into .gpu/wheels/, and copies the default model's tokenizer
files into .gpu/tokenizer/ (its wheel is too large to carry: the GPU host builds a
random-weight stand-in with that tokenizer, bench/standin.py). .gpu/ is git-ignored.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
DEST = REPO / ".gpu"
CARRY_LIMIT = 64 * 2**20  # the device tool's limit for the working tree and what it carries
# What the server, its tests and `transformers serve` (openai) import; their dependencies
# follow (`closure`), less what the GPU host's image holds.
ROOTS = ("fastapi", "uvicorn", "httptools", "pydantic", "jsonschema", "xgrammar", "gguf",
         "openai", "prometheus-client", "pytest-timeout")  # fmt: skip
# The distributions of the GPU hosts' image, as /work/.library/device/KINDS.md lists them.
_HOST_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc attrs
botorch build certifi charset-normalizer click cloudpickle cmake colorama coverage cython
einops filelock fsspec h11 hf-xet httpcore httpx huggingface-hub hypothesis idna iniconfig
jinja2 joblib markdown markdown-it-py markupsafe mdurl mpmath msgpack multidict networkx
ninja numpy nvidia-ml-py packaging pandas pillow pip pluggy prometheus-client propcache
protobuf psutil pygments pyparsing pytest pytest-timeout pytest-xdist execnet
python-dateutil pyyaml regex requests rich safetensors scipy sentencepiece setuptools
shellingham six sympy tiktoken tokenizers torch tqdm transformers triton typer urllib3
uvloop wheel wrapt yarl zipp
"""
# typing-extensions and anyio are on the image too, but pydantic and starlette need recent
# ones, and an older one there would stop the server importing: ours travel and shadow
# them (both are small and pure Python).
HOST_HAS = frozenset(_HOST_PACKAGES.split())
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "any")  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: tuple[str, ...]) -> list[str]:
    """The installed distributions `roots` need, transitively (no extras), that the host
    lacks: `name==version` pins from this venv."""
    seen: set[str] = set()
    todo = [_key(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": "", "python_version": "3.12"}):
                todo.append(_key(req.name))
    return sorted(f"{n}=={metadata.version(n)}" for n in seen - HOST_HAS)


def download_wheels(dest: Path) -> list[Path]:
    pins = closure(ROOTS)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest),
         *pins],
        check=True,
    )  # fmt: skip
    return sorted(dest.glob("*.whl"))


def copy_tokenizer(dest: Path) -> None:
    from engine.loader import resolve_model_dir

    source = resolve_model_dir(None)
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, dest / name)


def tracked_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")  # fmt: skip
    return sum((REPO / f).stat().st_size for f in files if f and (REPO / f).is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    shutil.rmtree(DEST / "wheels", ignore_errors=True)
    wheels = download_wheels(DEST / "wheels")
    copy_tokenizer(DEST / "tokenizer")
    packed = sum(f.stat().st_size for f in DEST.rglob("*") if f.is_file())
    total = packed + tracked_bytes()
    print(f"{len(wheels)} wheels and the tokenizer in {DEST}: {packed / 2**20:.1f} MiB; "
          f"with the checkout {total / 2**20:.1f} of {CARRY_LIMIT / 2**20:.0f} MiB")  # fmt: skip
    if total > CARRY_LIMIT:
        print("too large to carry: drop a package or a file", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
