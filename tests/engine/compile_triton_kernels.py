"""Compile the Triton backend's kernels for NVIDIA GPUs on a machine without one.

    python -m tests.engine.compile_triton_kernels [sm_90 ...]

Triton lowers a kernel to PTX and assembles it with the ptxas its wheel brings, with no
GPU needed: this compiles `_paged_attention_kernel` for the compile-time arguments real
steps give it (`attention_constexprs`: decode batches with and without splits, prefill
tiles; the head layouts of the default model and of 1B/8B/Qwen shapes; bf16, fp16,
float32), the split merge, the KV write and the Triton layer ops
(engine/models/triton_ops.py), and prints one line per kernel with the registers and
spilled bytes ptxas reports for the attention kernel and the layer ops. It must run
without TRITON_INTERPRET (under the interpreter a kernel is not compiled at all), which is
why tests/engine/test_triton_compile.py runs it in a child process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from engine.attention import AttentionMetadata
from engine.attention import triton_paged as tp

# (num_heads, num_kv_heads, head_dim): SmolLM2-135M, TinyLlama-1.1B, Llama-3-8B, Qwen2.5-0.5B
LAYOUTS = [(9, 3, 64), (32, 4, 64), (32, 8, 128), (14, 2, 64)]
TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def steps() -> dict[str, AttentionMetadata]:
    """A decode step split over a long context, a batch of decodes large enough to need
    no splits in every layout (`ENOUGH_PROGRAMS`), and a mixed step."""

    def meta(q_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        tables = [list(range(-(-s // 16))) for s in seq_lens]
        return AttentionMetadata.build(q_lens, seq_lens, tables, 16, "cpu")

    return {
        "decode-split": meta([1], [2000]),
        "decode": meta([1] * 512, [500] * 512),
        "prefill": meta([1, 300], [40, 300]),
    }


def attention_signature(dtype: str, split: bool) -> dict[str, str]:
    types = {}
    for name in tp._paged_attention_kernel.arg_names:
        if name.isupper():
            types[name] = "constexpr"
        elif name in ("q_ptr", "k_cache_ptr", "v_cache_ptr"):
            types[name] = f"*{dtype}"
        elif name in ("out_ptr", "lse_ptr"):  # split partials and their lse are float32
            types[name] = "*fp32" if split else f"*{dtype}"
        elif name.endswith("_ptr"):
            types[name] = "*i32"
        else:
            types[name] = "fp32" if name == "scale" else "i32"
    return types


def registers_and_spills(ptx: str, arch: int) -> tuple[int, int]:
    """What ptxas -v reports for the kernel: registers per thread, bytes spilled (stored)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", path, "-o", path + ".o"]
        report = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return registers, spills


def variants() -> list[tuple[torch.dtype, str, tuple[int, int, int], str, AttentionMetadata]]:
    """(dtype, its Triton name, head layout, step name, step) for every attention kernel
    variant compiled: every layout in bf16, the 1B layout in the other dtypes."""
    return [
        (dtype, name, layout, step, meta)
        for dtype, name in TRITON_DTYPES.items()
        for layout in (LAYOUTS if dtype == torch.bfloat16 else LAYOUTS[1:2])
        for step, meta in steps().items()
    ]


def compile_all(arch: str) -> int:
    target = GPUTarget("cuda", int(arch.removeprefix("sm_")), 32)
    count = 0
    for dtype, name, (heads, kv_heads, head_dim), step, meta in variants():
        plan = tp.plan_step(meta, kv_heads)
        consts = tp.attention_constexprs(plan, heads // kv_heads, head_dim, 16, dtype)
        signature = attention_signature(name, plan.num_splits > 1)
        warps = {"num_warps": consts.pop("num_warps")}
        kernel = triton.compile(
            ASTSource(tp._paged_attention_kernel, signature, consts),
            target=target,
            options=warps,
        )
        regs, spills = registers_and_spills(kernel.asm["ptx"], target.arch)
        print(f"{arch} attention {name} {heads}/{kv_heads}x{head_dim} {step}: {consts}, "
              f"{warps['num_warps']} warps, {regs} registers, {spills} bytes spilled")  # fmt: skip
        count += 1
    merge = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16"}
    merge |= {n: "i32" for n in tp._merge_splits_kernel.arg_names if n not in merge}
    merge |= dict.fromkeys(("NUM_SPLITS", "BLOCK_S", "BLOCK_D"), "constexpr")
    consts = {"NUM_SPLITS": 8, "BLOCK_S": 8, "BLOCK_D": 64}
    triton.compile(ASTSource(tp._merge_splits_kernel, merge, consts), target=target)
    write = dict.fromkeys(("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr"), "*bf16")
    write |= {"slot_ptr": "*i64", "row_elems": "i32", "BLOCK": "constexpr"}
    triton.compile(ASTSource(tp._write_kv_kernel, write, {"BLOCK": 1024}), target=target)
    print(f"{arch} merge and write_kv compiled")
    return count + 2 + compile_layer_ops(target)


def layer_op_variants() -> list[tuple[str, object, dict[str, str], dict[str, object], int]]:
    """(name, kernel, signature, constexprs, warps) of the Triton layer ops in bf16: the
    norm at the 1B's and the 8B's hidden sizes, silu, rotary at head_dim 64 and 128."""
    from engine.models import triton_ops as ops

    def signature(kernel, pointers: tuple[str, ...], floats: tuple[str, ...] = ()) -> dict:
        types = {}
        for name in kernel.arg_names:
            upper = name.isupper()
            types[name] = ("constexpr" if upper else "*bf16" if name in pointers
                           else "fp32" if name in floats else "i32")  # fmt: skip
        return types

    norm = signature(ops._add_rms_norm_kernel, ("delta_ptr", "res_ptr", "w_ptr", "out_ptr",
                                                "res_out_ptr"), ("eps",))  # fmt: skip
    silu = signature(ops._silu_mul_kernel, ("gu_ptr", "out_ptr"))
    rope = signature(ops._rope_kernel, ("qkv_ptr", "cos_ptr", "sin_ptr", "out_ptr"))
    return [
        *((f"add_rms_norm {n}", ops._add_rms_norm_kernel, norm,
           {"HAS_RES": True, "BLOCK": n}, ops.norm_warps(n)) for n in (2048, 4096)),
        ("silu_mul", ops._silu_mul_kernel, silu, {"BLOCK": ops.SILU_BLOCK}, 4),
        *((f"rope {d}", ops._rope_kernel, rope, {"HALF": d // 2}, 1) for d in (64, 128)),
    ]  # fmt: skip


def compile_layer_ops(target: GPUTarget) -> int:
    for name, kernel, signature, consts, warps in layer_op_variants():
        compiled = triton.compile(ASTSource(kernel, signature, consts), target=target,
                                  options={"num_warps": warps})  # fmt: skip
        regs, spills = registers_and_spills(compiled.asm["ptx"], target.arch)
        print(f"sm_{target.arch} layer op {name}: {warps} warps, {regs} registers, "
              f"{spills} bytes spilled")  # fmt: skip
    return len(layer_op_variants())


def main(archs: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter compiles nothing")
    total = sum(compile_all(arch) for arch in archs or ["sm_90"])
    print(f"compiled {total} kernels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
