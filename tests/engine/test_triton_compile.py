"""The Triton kernels compile for a Hopper GPU (sm_90: the H100s and H200s this project is
lent) on this machine, which has none: Triton's own ptxas assembles the PTX. The tests
under the interpreter check what the kernels compute; this checks that the GPU compiler
takes them, for the compile-time arguments real steps give them
(tests/engine/compile_triton_kernels.py), and that ptxas spills no register."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton comes with torch's CUDA build and xgrammar")

from tests.engine.compile_triton_kernels import layer_op_variants, variants  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def compile_in_child(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    """Python with `args`, without the interpreter (which compiles nothing)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_the_kernels_compile_for_sm_90(tmp_path):
    done = compile_in_child(["-m", "tests.engine.compile_triton_kernels", "sm_90"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    planned = len(variants())  # every attention variant, plus the merge and the KV write
    ops = len(layer_op_variants())  # and the Triton layer ops
    assert lines[-1] == f"compiled {planned + 2 + ops} kernels"
    assert any("decode-split" in line and "'NUM_SPLITS': 8" in line for line in lines)
    assert any(" decode:" in line and "'NUM_SPLITS': 1" in line for line in lines)
    assert any("32/8x128 prefill" in line and "'BLOCK_D': 128" in line for line in lines)
    assert any("14/2x64 prefill" in line and "'ROWS': 128" in line for line in lines)  # GQA 7
    attention = [line for line in lines if " attention " in line]
    assert len(attention) == planned
    # The tile sizes keep every variant in registers (spills would be local-memory traffic
    # on every key tile).
    assert all(line.endswith(" 0 bytes spilled") for line in attention), "\n".join(attention)
    layer_ops = [line for line in lines if " layer op " in line]
    assert len(layer_ops) == ops
    assert all(line.endswith(" 0 bytes spilled") for line in layer_ops), "\n".join(layer_ops)


# The sliding-window variants (`WINDOW`, Gemma 3 1B's 512) of the 1B and 8B layouts in bf16:
# a decode split over the window, unsplit decodes, a prefill step.
WINDOWED = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.attention import triton_paged as tp
from tests.engine.compile_triton_kernels import LAYOUTS, attention_signature, registers_and_spills, steps
target = GPUTarget("cuda", 90, 32)
for heads, kv_heads, head_dim in LAYOUTS[1:3]:
    for step, meta in steps().items():
        plan = tp.plan_step(meta, kv_heads, window=512)
        consts = tp.attention_constexprs(plan, heads // kv_heads, head_dim, 16, torch.bfloat16,
                                         window=512)
        warps = {"num_warps": consts.pop("num_warps")}
        signature = attention_signature("bf16", plan.num_splits > 1)
        kernel = triton.compile(ASTSource(tp._paged_attention_kernel, signature, consts),
                                target=target, options=warps)
        regs, spills = registers_and_spills(kernel.asm["ptx"], target.arch)
        print(f"{heads}/{kv_heads}x{head_dim} {step}: {consts}, {regs} registers, "
              f"{spills} bytes spilled")
"""


def test_the_windowed_kernels_compile_for_sm_90(tmp_path):
    done = compile_in_child(["-c", WINDOWED], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 6 and all("'WINDOW': 512" in line for line in lines)
    assert any("decode-split" in line and "'NUM_SPLITS': 2" in line for line in lines)
    assert all(line.endswith(" 0 bytes spilled") for line in lines), "\n".join(lines)
