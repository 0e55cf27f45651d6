"""$PAGEDSERVE_CPU_KERNELS: auto, avx2 (the AVX2 path on an AVX-512 machine, so one machine
tests both CPU kinds' paths), avx512_vnni (a Cascade Lake Xeon's path on a later AVX-512 CPU)
or off; anything else is an error, not the other path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.kernels import (
    CPU_KERNEL_FLAGS,
    GGML_KERNEL_FLAGS,
    SWITCH,
    VNNI512_KERNEL_FLAGS,
    _reported_flags,
    switch,
    visible_flags,
)

REPO = Path(__file__).resolve().parents[2]
# What a 2-core Zen 5 EPYC reports (the AVX-512 part of it, and what AVX2 needs).
ZEN5 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f",
                  "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni",
                  "avx512_vbmi2", "avx512_bitalg"})  # fmt: skip


def test_the_avx2_setting_hides_avx512_so_the_avx2_build_is_planned():
    assert visible_flags(ZEN5, "auto") == ZEN5 and ZEN5 >= CPU_KERNEL_FLAGS
    avx2 = visible_flags(ZEN5, "avx2")
    assert not any(flag.startswith(("avx512", "amx")) for flag in avx2)
    assert not avx2 >= CPU_KERNEL_FLAGS  # no AVX-512 build: cpu_kernels() is None
    assert avx2 >= GGML_KERNEL_FLAGS  # the AVX2 build serves
    assert "avx_vnni" in avx2  # AVX-VNNI is an AVX2-class extension: it stays
    assert visible_flags(ZEN5, "off") == ZEN5  # off builds nothing whatever the flags


# What a 2-core Cascade Lake Xeon reports (family 6 model 85; the same parts).
CASCADE_LAKE = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512cd",
                          "avx512dq", "avx512bw", "avx512vl", "avx512_vnni"})  # fmt: skip
SAPPHIRE_RAPIDS = CASCADE_LAKE | {"avx_vnni", "avx512_bf16", "avx512_fp16", "avx512vbmi",
                                  "avx512_vbmi2", "amx_tile", "amx_int8", "amx_bf16"}  # fmt: skip


@pytest.mark.parametrize("later", [ZEN5, SAPPHIRE_RAPIDS])
def test_the_avx512_vnni_setting_shows_a_later_cpu_as_a_cascade_lake(later):
    """No BF16 (so no AVX-512 BF16 build, float32 activations), no AMX, no AVX-VNNI; the
    AVX-512 VNNI build's flags kept."""
    seen = visible_flags(later, "avx512_vnni")
    assert seen == later & CASCADE_LAKE
    assert not seen >= CPU_KERNEL_FLAGS and seen >= VNNI512_KERNEL_FLAGS
    assert visible_flags(CASCADE_LAKE, "avx512_vnni") == CASCADE_LAKE  # the real one: unchanged
    assert visible_flags(CASCADE_LAKE, "auto") >= VNNI512_KERNEL_FLAGS  # auto takes it there


@pytest.mark.parametrize(
    ("value", "setting"),
    [("", "auto"), ("auto", "auto"), ("AVX2", "avx2"), (" avx2 ", "avx2"), ("off", "off"),
     ("0", "off"), ("false", "off"), ("no", "off"), ("AVX512_VNNI", "avx512_vnni")],
)  # fmt: skip
def test_the_switch_reads_its_settings(monkeypatch, value, setting):
    monkeypatch.setenv(SWITCH, value)
    assert switch() == setting


def test_a_mistyped_switch_is_an_error_not_the_other_path(monkeypatch):
    monkeypatch.setenv(SWITCH, "avx-2")
    with pytest.raises(ValueError, match=r"PAGEDSERVE_CPU_KERNELS is 'avx-2': use one of auto"):
        switch()


# Per setting: whether any AVX-512 flag stays visible, torch's ISA caps, the flags the
# setting's own build needs, and the start-up line's name for it.
SETTINGS = {
    "avx2": (False, ("avx2", "AVX2"), GGML_KERNEL_FLAGS, "pagedserve_avx2_kernels", "AVX2"),
    "avx512_vnni": (True, ("avx512", "AVX512_CORE_VNNI"), VNNI512_KERNEL_FLAGS,
                    "pagedserve_vnni512_kernels", "AVX-512 VNNI"),
}  # fmt: skip


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_process_under_a_setting_plans_and_serves_that_path(setting):
    """In a fresh process (the detection is cached per process): no AVX512-BF16 seen, no
    AVX-512 BF16 module, the GGUF kernels from the setting's build where the CPU has its
    flags, float32 activations, and torch's own ops held to that ISA when engine is
    imported first."""
    avx512_kept, isa, flags, module, name = SETTINGS[setting]
    probe = """
import json, os, engine, torch
from engine.config import EngineConfig
from engine.execution_plan import resolve_dtype
from engine.kernels import build_name, cpu_flags, cpu_kernels, ggml_kernels
print(json.dumps({
    "build": None if ggml_kernels() is None else build_name(ggml_kernels()),
    "avx512_seen": any(f.startswith("avx512") for f in cpu_flags()),
    "bf16_seen": "avx512_bf16" in cpu_flags(),
    "avx512_module": cpu_kernels() is not None,
    "ggml_module": None if ggml_kernels() is None else ggml_kernels().__name__,
    "dtype": str(resolve_dtype(EngineConfig(), torch.device("cpu"))),
    "aten": os.environ.get("ATEN_CPU_CAPABILITY"),
    "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA"),
}))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY",
                                                             "ONEDNN_MAX_CPU_ISA")}  # fmt: skip
    env[SWITCH] = setting
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=600, check=True)  # fmt: skip
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["bf16_seen"] is False and seen["avx512_module"] is False
    assert seen["avx512_seen"] is (avx512_kept and "avx512f" in _reported_flags())
    assert seen["dtype"] == "torch.float32"
    assert (seen["aten"], seen["onednn"]) == isa
    if visible_flags(_reported_flags(), setting) >= flags:  # the CPU has them: that build serves
        assert seen["ggml_module"].startswith(module), seen
        assert seen["build"] == f"{name}, $PAGEDSERVE_CPU_KERNELS={setting}"  # the start-up line's
