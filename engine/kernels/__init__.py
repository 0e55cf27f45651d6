"""Native CPU kernels, compiled on first use by torch's C++ extension loader.

`cpu_kernels()` returns the compiled module, or None where it cannot run (no AVX512-BF16,
no C++ compiler): callers then use torch's own ops, which are always correct. The build
(about a minute, once per Python environment; `make` does it at install time with ``python -m
engine.kernels``) lands in torch's extension cache, ``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``, under a name keyed by the environment: two virtualenvs
sharing that cache would otherwise rebuild it in turn, each build waiting on the other's
lock. A build killed half-way (SIGKILL, power loss) leaves nothing that blocks or breaks the
next start: see `_build_lock` and `_drop_unverified`. ``PAGEDSERVE_CPU_KERNELS=off`` builds
and loads none: torch's ops serve (to rule the kernels out, or where no build should run).
``PAGEDSERVE_CPU_KERNELS=avx2`` hides AVX-512 from the detection (`cpu_flags`): an AVX-512
machine then builds, plans and serves the AVX2 path, so one machine tests both.
``PAGEDSERVE_CPU_KERNELS=avx512_vnni`` hides what a Cascade Lake Xeon lacks (AVX512-BF16,
AMX, the later AVX-512 extensions): an AVX-512 BF16 machine then serves that kind's path.

* ``skinny_linear(x, weight, scales, bias)``: decode-sized matmuls (`csrc/skinny_gemm.cpp`)
* ``paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)``: decode
  attention straight from the paged cache (`csrc/paged_decode.cpp`)
* ``add_rms_norm``, ``rope_write_kv``, ``silu_mul``: the small ops around a layer's
  matmuls, one call each (`csrc/fused_ops.cpp` bf16, `csrc/fused_ops_f32.cpp` float32)
* ``DecodeStack``: a decode-only step's decoder layers in one call, through the kernels
  above (`csrc/decode_stack.cpp`)
* ``gated_delta_decode(mixed_qkv, g, beta, conv_weight, conv_states, states, slots,
  num_k_heads)``: a Gated DeltaNet layer's decode step for every request in one call
  (`csrc/gated_delta_net.cpp`, both builds; `engine.models.gated_delta_net.gdn_decode`)
* ``apply_token_bitmask_(logits, bitmask, rows)``: a grammar's allowed tokens on float32
  logits, -inf elsewhere (`csrc/token_bitmask.cpp`)

* ``ggml_dequantize``, ``ggml_linear``: GGUF weights served from their own blocks
  (`csrc/ggml_quants.cpp`; IQ4_NL/IQ4_XS/MXFP4 in `csrc/ggml_table4.cpp`, Q2_K/Q3_K in
  `csrc/ggml_q23_k.cpp`, IQ2_XXS/IQ2_XS/IQ2_S/IQ3_XXS/IQ3_S in `csrc/ggml_iq_grid.cpp`,
  F16/BF16 weights in `csrc/ggml_f16.cpp`), also a `DecodeStack` projection

`ggml_kernels()` is the module with the GGUF kernels: this one, or on a CPU without
AVX512-BF16 a build of them with the float32 layer ops, paged decode attention and decode
stack (`AVX2_SOURCES`), which serve a GGUF with float32 activations there: with 512-bit VNNI
integer dots where the CPU has AVX512-VNNI (Cascade Lake, Ice Lake), else AVX2's `maddubs`.
`layer_kernels(dtype, device, quantization)` says which module, if any, a model's layers use.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# Both builds: the GGUF kernels, and the float32 layer ops and decode stack that serve them
# with float32 activations (AVX2).
AVX2_SOURCES = (
    "bindings.cpp",
    "dispatch.cpp",
    "fused_ops_f32.cpp",
    "paged_decode_f32.cpp",
    "decode_stack.cpp",
    "moe_sum.cpp",
    "ggml_quants.cpp",
    "gated_delta_net.cpp",
    "ggml_table4.cpp",
    "ggml_q23_k.cpp",
    "ggml_iq_grid.cpp",
    "ggml_f16.cpp",
)
# The AVX512-BF16 build adds the bf16 and int8/int4 kernels.
SOURCES = (
    *AVX2_SOURCES,
    "skinny_gemm.cpp",
    "paged_decode.cpp",
    "fused_ops.cpp",
    "token_bitmask.cpp",
)
# The flags the intrinsics need; the build targets exactly these, not -march=native, so a
# cached build stays valid on any CPU that has them.
CPU_KERNEL_FLAGS = frozenset(
    {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx2", "fma", "f16c"}
)
# (Every CPU with AVX512-BF16 has AVX512-VNNI: Cooper Lake, Sapphire Rapids, Zen 4 and 5.)
_ISA_CFLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mavx2",
               "-mfma", "-mf16c", "-DPAGEDSERVE_BF16_KERNELS"]  # fmt: skip


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags this process plans for: what Linux reports (empty elsewhere:
    then no kernel is assumed), less AVX-512 and AMX under ``$PAGEDSERVE_CPU_KERNELS=avx2``."""
    return visible_flags(_reported_flags(), switch())


# What a Cascade Lake Xeon has of AVX-512 (Skylake-SP's and VNNI); Ice Lake adds extensions
# (VBMI, VPOPCNTDQ...) that no kernel here uses.
CASCADE_LAKE_AVX512 = frozenset(
    {"avx512f", "avx512cd", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni"}
)


def visible_flags(flags: frozenset[str], setting: str) -> frozenset[str]:
    """``flags`` as the kernels and the config see them: the AVX2 path hides AVX-512 and
    AMX, so an AVX-512 machine plans, builds and serves exactly as an AVX2-only one; the
    avx512_vnni path keeps only a Cascade Lake's AVX-512 (no BF16, no AMX, no AVX-VNNI)."""
    if setting == "avx2":
        return frozenset(f for f in flags if not f.startswith(("avx512", "amx")))
    if setting == "avx512_vnni":
        later = ("avx512", "amx", "avx_vnni")
        return frozenset(f for f in flags if not f.startswith(later) or f in CASCADE_LAKE_AVX512)
    return flags


def _reported_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cpu_kernels_supported() -> bool:
    return cpu_flags() >= CPU_KERNEL_FLAGS


GGML_KERNEL_FLAGS = frozenset({"avx2", "fma", "f16c"})
# AVX-512 with VNNI and without BF16 (Cascade Lake, Ice Lake): the same sources as the AVX2
# build, whose GGUF kernels then take their AVX-512 VNNI tiles (`vpdpbusd` on 64 bytes), the
# ones the BF16 build runs, on float32 activations.
VNNI512_KERNEL_FLAGS = GGML_KERNEL_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
_VNNI512_CFLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
# -ffp-contract=off: dequantization must round exactly as ggml does (no fused multiply-add
# the source does not write); the other kernels write their FMAs out as intrinsics.
_GGML_CFLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"]


def build_dir(name: str) -> Path:
    """Where torch builds extension `name`: $TORCH_EXTENSIONS_DIR, else torch's cache root."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name


@contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Held around a build and load. torch's own lock is a file that its builder removes
    when done, so a build killed half-way leaves it behind and every later start waits on
    it forever. This flock dies with its holder; every build of ours takes it first, so a
    torch lock file found under it is such a leftover, and is removed."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "pagedserve.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield


SWITCH = "PAGEDSERVE_CPU_KERNELS"
# auto: the kernels this CPU runs best; avx2: the AVX2 path on any CPU that has AVX2 (to
# serve or test an AVX2-only machine's path on an AVX-512 one); avx512_vnni: a Cascade Lake
# Xeon's path on any CPU with AVX512-VNNI; off: torch's ops only.
SWITCH_SETTINGS = ("auto", "avx2", "avx512_vnni", "off")
_OFF_SPELLINGS = ("0", "off", "false", "no")


def switch() -> str:
    """$PAGEDSERVE_CPU_KERNELS as one of `SWITCH_SETTINGS`; ValueError for anything else
    (a typo must not quietly test the other path)."""
    value = os.environ.get(SWITCH, "").strip().lower() or "auto"
    value = "off" if value in _OFF_SPELLINGS else value
    if value not in SWITCH_SETTINGS:
        raise ValueError(f"${SWITCH} is {value!r}: use one of {', '.join(SWITCH_SETTINGS)}")
    return value


def switched_off() -> bool:
    return switch() == "off"


def _build(name: str, sources: list[Path], cflags: list[str]) -> ModuleType | None:
    """Compile (once, cached by torch) and load an extension; None where that fails or
    $PAGEDSERVE_CPU_KERNELS says off."""
    from torch.utils.cpp_extension import load

    if switched_off():
        logger.info("CPU kernels %s off ($%s): using torch's ops", name, SWITCH)
        return None

    env = hashlib.sha256(f"{sys.prefix}|{torch.__version__}".encode()).hexdigest()[:10]
    full_name = f"{name}_{env}"
    directory = build_dir(full_name)
    try:
        with _build_lock(directory):
            _drop_unverified(directory)
            module = load(name=full_name, sources=[str(s) for s in sources],
                          extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                          build_directory=str(directory))  # fmt: skip
            _record_libraries(directory)
            return module
    except Exception as exc:  # no compiler, headers, ninja...: torch's ops still work
        logger.warning("CPU kernels %s unavailable, using torch's ops: %s", name, exc)
        return None


# The checksums of the libraries that loaded: one torn on disk (power lost after the build
# was logged as done) would otherwise be taken as up to date, and loading it can crash.
_CHECKSUMS = "pagedserve.sha256.json"


def _libraries(directory: Path) -> dict[str, str]:
    return {lib.name: hashlib.sha256(lib.read_bytes()).hexdigest()
            for lib in sorted(directory.glob("*.so"))}  # fmt: skip


def _drop_unverified(directory: Path) -> None:
    """Empties the build directory if a library in it is not one that loaded before."""
    try:
        known = json.loads((directory / _CHECKSUMS).read_text())
    except (OSError, ValueError):
        known = {}
    if any(known.get(lib) != digest for lib, digest in _libraries(directory).items()):
        logger.warning("CPU kernels in %s do not match what was built: building them again",
                       directory)  # fmt: skip
        for entry in directory.iterdir():
            if entry.name != "pagedserve.flock":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def _record_libraries(directory: Path) -> None:
    tmp = directory / f"{_CHECKSUMS}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(_libraries(directory)))
    tmp.replace(directory / _CHECKSUMS)


# The builds of `AVX2_SOURCES` for CPUs without AVX512-BF16, best first: (the path's name,
# the extension's, the flags it needs, its compiler flags).
FLOAT32_BUILDS = (
    ("AVX-512 VNNI", "pagedserve_vnni512_kernels", VNNI512_KERNEL_FLAGS,
     [*_GGML_CFLAGS, *_VNNI512_CFLAGS]),
    ("AVX2", "pagedserve_avx2_kernels", GGML_KERNEL_FLAGS, _GGML_CFLAGS),
)  # fmt: skip


@lru_cache(maxsize=1)
def ggml_kernels() -> ModuleType | None:
    """The GGUF block kernels and the float32 layer ops and decode stack: the AVX-512 BF16
    module where it builds, else the best of `FLOAT32_BUILDS` this CPU runs and builds;
    None where the CPU lacks AVX2/FMA/F16C or none builds (then a GGUF's weights are
    dequantized at load)."""
    if (kernels := cpu_kernels()) is not None:
        return kernels
    sources = [CSRC / source for source in AVX2_SOURCES]
    for _, name, flags, cflags in FLOAT32_BUILDS:
        if cpu_flags() >= flags and (module := _build(name, sources, cflags)) is not None:
            return module
    return None


@lru_cache(maxsize=1)
def cpu_kernels() -> ModuleType | None:
    """The compiled kernels, or None (then torch's ops serve, and a warning says why)."""
    if not cpu_kernels_supported():
        return None
    sources = [CSRC / source for source in SOURCES]
    return _build("pagedserve_cpu_kernels", sources, [*_GGML_CFLAGS, *_ISA_CFLAGS])


def path_name(module: ModuleType) -> str:
    """Which CPU path a kernels module is: "AVX-512 BF16", "AVX-512 VNNI" or "AVX2" (by its
    extension's name: a test may hide a module from `cpu_kernels` and still hold it)."""
    builds = [("AVX-512 BF16", "pagedserve_cpu_kernels"), *(b[:2] for b in FLOAT32_BUILDS)]
    return next(path for path, name in builds if module.__name__.startswith(name))


def build_name(module: ModuleType) -> str:
    """The path as the start-up line names it, with the switch where it is set."""
    name = path_name(module)
    return name if switch() == "auto" else f"{name}, ${SWITCH}={switch()}"


def host_kernels(device: torch.device | str) -> ModuleType | None:
    """The kernels for work on this device whatever the model's dtype (the sampler's float32
    logits), or None off the CPU or where they do not build."""
    return cpu_kernels() if torch.device(device).type == "cpu" else None


def bf16_cpu_kernels(dtype: torch.dtype, device: torch.device | str) -> ModuleType | None:
    """The kernels, when a model of this dtype on this device can use them (bf16 on a CPU
    where they build), else None: the one place that decides it."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return None
    return cpu_kernels()


def layer_kernels(
    dtype: torch.dtype, device: torch.device | str, quantization: str | None
) -> ModuleType | None:
    """The module whose layer ops (norms, rotary, silu), paged decode attention and decode
    stack serve a model of this dtype and quantization on this device, else None (torch's
    ops serve): bf16 on a CPU with AVX512-BF16; float32 where a GGUF's blocks serve every
    projection (quantization "gguf", on CPUs without AVX512-BF16), since the float32
    reference path (a Hugging Face checkpoint or --dtype float32) stays torch's own ops,
    token for token what transformers computes."""
    if torch.device(device).type != "cpu":
        return None
    if dtype == torch.float32 and quantization == "gguf":
        return ggml_kernels()
    return bf16_cpu_kernels(dtype, device)
