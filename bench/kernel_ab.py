"""Two builds of the GGUF kernels in one process: each projection of one layer of a GGUF,
multiplied by both at several row counts, outputs compared bit for bit, medians of
interleaved calls.

    git worktree add /tmp/prev HEAD~1     # or any checkout: its engine/kernels/csrc is read
    .venv/bin/python -m bench.kernel_ab --other /tmp/prev/engine/kernels/csrc \
        --model /tmp/standins/1b-standin.Q4_K_M.gguf --rows 1,4,8,32,512 --threads 1,2

Both builds compile the AVX2 sources (`engine.kernels.AVX2_SOURCES`) with the project's
flags into their own build directories under --build-dir, so neither touches the engine's
cached build; the model's weights are loaded (and regrouped) once, by this checkout's
engine. Ratios are the other build's time over this one's: above 1, this checkout is faster.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import ModuleType

import torch

from bench.machine import machine_line

PROJECTIONS = ("qkv", "o", "gate_up", "down")


def build(name: str, csrc: Path, build_dir: Path) -> ModuleType:
    """The AVX2 build of the kernels in `csrc`, as extension `name`."""
    from torch.utils.cpp_extension import load

    from engine import kernels

    directory = build_dir / name
    directory.mkdir(parents=True, exist_ok=True)
    return load(name=name, sources=[str(csrc / s) for s in kernels.AVX2_SOURCES],
                extra_cflags=kernels._GGML_CFLAGS, extra_ldflags=["-fopenmp"],
                build_directory=str(directory))  # fmt: skip


def median_ms(fn, x, weights, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(x, *weights)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def compare(other: ModuleType, this: ModuleType, layer, rows: int, repeat: int) -> str:
    """One line: per projection, other -> this ms (ratio), and the layer's total."""
    cells, totals = [], [0.0, 0.0]
    for name, linear in zip(PROJECTIONS, layer.linears(), strict=True):
        method = linear.method
        x = torch.randn(rows, method.in_features)
        same = torch.equal(other.ggml_linear(x, *method.ggml), this.ggml_linear(x, *method.ggml))
        a, b = [], []
        for _ in range(repeat):  # interleaved, so drift hits both
            a.append(median_ms(other.ggml_linear, x, method.ggml, 1))
            b.append(median_ms(this.ggml_linear, x, method.ggml, 1))
        ma, mb = statistics.median(a), statistics.median(b)
        totals[0] += ma
        totals[1] += mb
        parts = "+".join(part for part, _ in method.parts)
        cells.append(f"{name}[{parts}] {ma:.2f}->{mb:.2f} ms ({ma / mb:.2f}x"
                     f"{'' if same else ', OUTPUTS DIFFER'})")  # fmt: skip
    ratio = totals[0] / totals[1]
    return (
        f"rows {rows}: "
        + "; ".join(cells)
        + f"; layer {totals[0]:.2f}->{totals[1]:.2f} ms ({ratio:.2f}x)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--other", type=Path, required=True, help="the other build's csrc directory"
    )
    parser.add_argument("--model", required=True, help="a GGUF whose blocks the kernels multiply")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--rows", default="1,4,8,32,512")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--build-dir", type=Path, default=Path("/tmp/pagedserve-kernel-ab"))
    args = parser.parse_args(argv)
    print(machine_line())
    here = Path(__file__).resolve().parent.parent / "engine" / "kernels" / "csrc"
    other = build("kernel_ab_other", args.other.resolve(), args.build_dir)
    this = build("kernel_ab_this", here, args.build_dir)

    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model, num_blocks=64))
    layer = engine.core.model.layers[args.layer]
    torch.manual_seed(0)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in (int(r) for r in args.rows.split(",")):
            print(
                f"threads {threads}, " + compare(other, this, layer, rows, args.repeat), flush=True
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
