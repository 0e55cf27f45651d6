"""Where a CUDA-graph decode step's time goes: the host's Python (cProfile) and the
device's kernels (torch.profiler), for one batch size on a Hugging Face model.

    python3 -m bench.gpu_step_profile --model DIR [--batch 1] [--context 2000] [--steps 30]

The engine is bench/gpu_step.py's `triton-graphs` one (requests past a skipped prefill).
It prints the median step time, the median time of the graph's run alone (CUDA events
around `CudaGraphRunner.run`: the inputs into its buffers and the replay), the top functions by cumulative host time over `--steps` steps, and the
profiler's table of the same steps by device time. A step much slower than its replay is
host-bound: the table says where.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from bench.gpu_step import WARMUP_STEPS, decoding_engine, gpu_line
from bench.machine import machine_line


def replay_ms(engine, steps: int) -> float | None:
    """Median ms of the graph runs during `steps` steps (CUDA events)."""
    graphs = engine.core.runner.graphs
    if graphs is None:
        return None
    times: list[float] = []
    original = graphs.run  # the step's inputs into the graph's buffers, then the replay

    def timed(*args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = original(*args, **kwargs)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        return out

    graphs.run = timed
    try:
        for _ in range(steps):
            engine.step()
    finally:
        graphs.run = original
    return statistics.median(times) if times else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda", help="cuda (cpu only to try the script)")
    args = parser.parse_args(argv)
    print(machine_line(), gpu_line(torch.device(args.device)), sep="\n")
    engine = decoding_engine(args.model, "triton-graphs", args.batch, args.context, args.dtype,
                             args.device, WARMUP_STEPS + 4 * args.steps + 8)  # fmt: skip
    for _ in range(WARMUP_STEPS):
        engine.step()
    step_times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        step_times.append((time.perf_counter() - start) * 1e3)
    replay = replay_ms(engine, args.steps)
    print(f"batch {args.batch}: step {statistics.median(step_times):.3f} ms (median of "
          f"{args.steps}); graph run alone {replay if replay is None else f'{replay:.3f}'} ms")  # fmt: skip
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
    print(text.getvalue())
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
