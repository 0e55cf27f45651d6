"""The decode step's projections alone: bf16, int8 and int4 weights through the skinny
GEMM kernel, and bf16 through torch's matmul (oneDNN; AMX where the CPU has it), on the
default model's shapes, 30 layers of distinct weights (so they stream from memory as in a
step), in turns.

    .venv/bin/python -m bench.skinny_gemm --rows 1,4,8 --threads 1,2

Needs the CPU kernels (AVX512-BF16). Times are medians of 7 passes over all 120
matrices; the ratio is to bf16 in the same pass.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bench.machine import machine_line

# (out, in) of the default model's fused qkv, o, gate/up and down projections.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
PASSES = 7


def main(argv: list[str] | None = None) -> int:
    from engine.kernels import cpu_kernels
    from engine.models.linear import quantize_int4, quantize_int8

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--threads", default="2")
    args = parser.parse_args(argv)
    kernels = cpu_kernels()
    if kernels is None:
        print("the CPU kernels are not available here (they need AVX512-BF16)")
        return 1
    print(machine_line())
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) for n, k in SHAPES * LAYERS]
    bf16 = [(w.bfloat16(), None) for w in weights]
    formats = {
        "bf16": bf16,
        "int8": [quantize_int8(w) for w, _ in bf16],
        "int4": [quantize_int4(w) for w in weights],
        "torch bf16": bf16,  # the same bf16 weights, through torch's matmul
    }

    def one_pass(name: str, xs: dict[int, torch.Tensor]) -> float:
        start = time.perf_counter()
        for w, packed in zip(weights, formats[name], strict=True):
            x = xs[w.shape[1]]
            if name == "int4":
                kernels.int4_linear(x, *packed, None)
            elif name == "torch bf16":
                F.linear(x, packed[0])
            else:
                kernels.skinny_linear(x, packed[0], packed[1], None)
        return time.perf_counter() - start

    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for _, k in SHAPES}
            times: dict[str, list[float]] = {name: [] for name in formats}
            for _ in range(PASSES):
                for name in formats:
                    times[name].append(one_pass(name, xs))
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            cells = ", ".join(f"{n} {m:.2f} ms ({ms['bf16'] / m:.2f}x)" for n, m in ms.items())
            print(f"{threads} threads, {rows} rows: {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
