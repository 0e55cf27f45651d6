"""The GGUF kernels' effective read bandwidth against the machine's, in the same run.

    .venv/bin/python -m bench.ggml_kernels                 # a 1B layer's shapes, every type
    .venv/bin/python -m bench.ggml_kernels --rows 1,4,16
    .venv/bin/python -m bench.ggml_kernels --prefill --rows 16,32,64,512 --types Q4_0,Q4_K
    .venv/bin/python -m bench.ggml_kernels --cpu-time --types Q4_K,Q2_K,IQ2_XXS --rows 1,4,32
    .venv/bin/python -m bench.ggml_kernels --cpu-time --types MXFP4,MXFP4-file --rows 1,4,32

A decode step reads every weight byte once, so a decode kernel is as fast as it can be when
it streams the weights at the machine's read bandwidth. This measures that bandwidth (a
STREAM-like sum over a 1 GiB buffer, far larger than any cache, on torch's threads), then
times `ggml_linear` on one 1B-class layer's projections (TinyLlama-1.1B's: fused q/k/v
2048 -> 2560, o 2048 -> 2048, fused gate/up 2048 -> 11264, down 5632 -> 2048) in each
format, cycling through enough copies of the layer that nothing stays in cache, and prints
the weight bytes read per second as a share of the measured bandwidth. Medians of
`--repeat` runs.

A type named ``TYPE-file`` keeps its blocks in the file's layout where ``TYPE`` is regrouped
by 8 rows at load: the kernels a weight served from the mapped file takes (`Linear.pack`'s
other choice, engine/quantization/gguf.py).

`--cpu-time`: on one thread, the CPU time a layer takes (`time.process_time`) instead of the
wall time, and each type's ratio to the first type's: the kernels' arithmetic cost, which
other processes on a busy machine change less than they change wall times (they still share
the caches and the memory bus).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from bench.machine import machine_line
from engine.kernels import ggml_kernels

# (out, in) of each projection of a TinyLlama-1.1B layer, q/k/v and gate/up fused.
LAYER = ((2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632))
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
COPIES = 8  # of the layer: 8 x 35-100 MB, past any L3


def median_seconds(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth(repeat: int) -> float:
    """GB/s of a sum over a 1 GiB float32 buffer on torch's threads."""
    buf = torch.ones(1 << 28)
    return buf.numel() * 4 / median_seconds(buf.sum, repeat) / 1e9


FILE_LAYOUT = "-file"  # a type's suffix: its blocks as the file holds them, not regrouped


def parse_type(name: str) -> tuple[GGMLQuantizationType, bool]:
    """``Q4_0`` -> (Q4_0, regrouped as at load); ``MXFP4-file`` -> (MXFP4, the file's layout)."""
    return GGMLQuantizationType[name.removesuffix(FILE_LAYOUT)], not name.endswith(FILE_LAYOUT)


def layer_blocks(name: str) -> list[tuple[torch.Tensor, int]]:
    """A 1B layer's projections as random blocks with finite f16 scales (no NaN work), laid
    out as `Linear.pack` lays them (Q4_0: regrouped by 8 rows; ``TYPE-file``: as the file
    holds them): (blocks, type) each."""
    qtype, regroup = parse_type(name)
    values, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    layer = []
    for n, k in LAYER:
        w = torch.from_numpy(rng.integers(0, 256, (n, k // values * size), dtype=np.uint8))
        w.view(-1, size)[:, :4] = 0x10  # d (and m / dmin)
        if qtype.name == "Q6_K":
            w.view(-1, 210)[:, 208:] = 0x10
        layer.append(ggml_kernels().ggml_repack(w, int(qtype), k) if regroup else (w, int(qtype)))
    return layer


def kernel_bandwidth(qtype: str, rows: int, repeat: int) -> tuple[float, float]:
    """(ms per layer, GB/s of weights read) for `rows` activation rows."""
    kernels = ggml_kernels()
    layers = [layer_blocks(qtype) for _ in range(COPIES)]
    xs = {k: torch.randn(rows, k) for _, k in LAYER}
    turn = [0]

    def step() -> None:
        turn[0] = (turn[0] + 1) % COPIES
        for (w, t), (_, k) in zip(layers[turn[0]], LAYER, strict=True):
            kernels.ggml_linear(xs[k], [w], [t])

    seconds = median_seconds(step, repeat)
    nbytes = sum(w.numel() for w, _ in layers[0])
    return seconds * 1e3, nbytes / seconds / 1e9


def cpu_ms(qtype: str, rows: int, repeat: int) -> float:
    """CPU ms (process time, torch on one thread) of one 1B layer's projections."""
    kernels = ggml_kernels()
    layer = layer_blocks(qtype)
    xs = {k: torch.randn(rows, k) for _, k in LAYER}

    def step() -> None:
        for (w, t), (_, k) in zip(layer, LAYER, strict=True):
            kernels.ggml_linear(xs[k], [w], [t])

    step()
    times = []
    for _ in range(repeat):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return statistics.median(times) * 1e3


def prefill_ms(qtype: str, rows: int, repeat: int) -> tuple[float, float]:
    """(int8 dots, dequantize to bf16 + torch's bf16 GEMM) ms for one 1B layer's
    projections on `rows` bf16 activation rows: the two paths `Linear` chooses between."""
    kernels = ggml_kernels()
    layer = layer_blocks(qtype)
    xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for _, k in LAYER}

    def dots() -> None:
        for (w, t), (_, k) in zip(layer, LAYER, strict=True):
            kernels.ggml_linear(xs[k], [w], [t])

    def gemm() -> None:
        for (w, t), (n, k) in zip(layer, LAYER, strict=True):
            weight = torch.empty(n, k, dtype=torch.bfloat16)
            kernels.ggml_dequantize(w, t, k, None, weight)
            torch.nn.functional.linear(xs[k], weight)

    return median_seconds(dots, repeat) * 1e3, median_seconds(gemm, repeat) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4", help="activation rows (decode batch sizes)")
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument(
        "--prefill", action="store_true",
        help="instead: int8 dots vs dequantize-to-bf16 + GEMM per call, bf16 activations",
    )  # fmt: skip
    parser.add_argument(
        "--cpu-time", action="store_true",
        help="instead: CPU ms per layer on one thread, and the ratio to the first type",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if ggml_kernels() is None:
        print("the GGUF kernels are not available on this CPU (they need AVX2, FMA, F16C)")
        return 1
    print(machine_line())
    print(f"threads: {torch.get_num_threads()}")
    if args.prefill:
        print("| type | rows | int8 dots ms / 1B layer | dequantize + bf16 GEMM ms | ratio |")
        print("|---|---:|---:|---:|---:|")
        for name in args.types.split(","):
            for rows in (int(r) for r in args.rows.split(",")):
                dots, gemm = prefill_ms(name, rows, args.repeat)
                print(f"| {name} | {rows} | {dots:.1f} | {gemm:.1f} | {dots / gemm:.2f}x |")
        return 0
    if args.cpu_time:
        torch.set_num_threads(1)
        names, rows = args.types.split(","), [int(r) for r in args.rows.split(",")]
        ms = {(name, m): cpu_ms(name, m, args.repeat)
              for name in names for m in rows}  # fmt: skip
        print(f"| type | rows | CPU ms / 1B layer, 1 thread | / {names[0]} |")
        print("|---|---:|---:|---:|")
        for name in names:
            for m in rows:
                ratio = ms[name, m] / ms[names[0], m]
                print(f"| {name} | {m} | {ms[name, m]:.1f} | {ratio:.2f}x |")
        return 0
    bandwidth = read_bandwidth(args.repeat)
    print(f"read bandwidth (1 GiB sum): {bandwidth:.1f} GB/s\n")
    print("| type | rows | ms / 1B layer | weights GB/s | of read bandwidth |")
    print("|---|---:|---:|---:|---:|")
    for name in args.types.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            ms, gbs = kernel_bandwidth(name, rows, args.repeat)
            print(f"| {name} | {rows} | {ms:.2f} | {gbs:.1f} | {gbs / bandwidth:.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
