"""Scheduler + KV-cache bookkeeping cost per step, with no model.

A synthetic trace (prompts in groups that share a prefix, a fixed number of
decode steps each) runs through the real Scheduler and KVCacheManager; the
"model" is a cheap function of the request, computed outside the timed
region. Timed: schedule() + update_from_output() per step.

Reported per scenario (prefix hit rate) and hash algorithm:
- median step time over the steady-state decode steps (max_num_seqs running,
  every scheduled request decoding one token), and that per request,
- median step time over the steps that admit requests (prefill tokens in it),
- microseconds per scheduled token over the whole trace (total / tokens),
and sha256 / builtin ratios from the same run (runs are interleaved, medians
over --repeats).

The clock is this thread's CPU time by default: on a shared 2-core machine
wall time mostly measures the other processes (a step that is descheduled
once costs a whole time slice). --clock wall for wall time.

    python -m bench.scheduler_bench            # ~1 min on a 2-core Xeon
    python -m bench.scheduler_bench --requests 512 --repeats 1   # quick look
    python -m bench.scheduler_bench --profile  # cProfile of one run, top functions
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/scheduler_bench.py`: find the packages
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig  # noqa: E402

VOCAB = 32_000
VOCABULARY = range(VOCAB)


@dataclass
class Scenario:
    name: str
    shared_len: int  # tokens each group's prompts share at the start
    group_size: int  # prompts per group


SCENARIOS = [
    Scenario("0% hits", 0, 1),
    Scenario("384/512 shared", 384, 16),
    Scenario("~90% hits", 480, 32),
]


@dataclass
class RunResult:
    decode_step_s: list[float]  # steps at max_num_seqs running, decodes only
    prefill_step_s: list[float]  # steps that schedule prefill tokens
    total_s: float  # schedule() + update_from_output() over the whole trace
    num_tokens: int  # tokens scheduled over the whole trace
    num_steps: int
    hit_rate: float
    num_preemptions: int


def make_requests(args: argparse.Namespace, scenario: Scenario) -> list[Request]:
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.decode_steps, ignore_eos=True)
    requests: list[Request] = []
    prefix: list[int] = []
    for i in range(args.requests):
        if i % scenario.group_size == 0:
            prefix = rng.choices(VOCABULARY, k=scenario.shared_len)
        tail = rng.choices(VOCABULARY, k=args.prompt_len - len(prefix))
        requests.append(Request(f"req-{i}", prefix + tail, params, arrival_time=0.0))
    return requests


def fake_token(request: Request) -> int:
    """Distinct per request and step, so decode blocks never collide across requests."""
    tokens = request.all_token_ids
    return (tokens[-1] * 31 + len(tokens) + hash(request.request_id)) % VOCAB


def run_once(args: argparse.Namespace, scenario: Scenario, hash_algo: str) -> RunResult:
    config = SchedulerConfig(
        max_num_seqs=args.max_running,
        max_num_batched_tokens=args.budget,
        max_model_len=args.prompt_len + args.decode_steps + 1,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        enable_prefix_caching=True,
        prefix_cache_hash=hash_algo,
    )
    sched = Scheduler(config)
    for request in make_requests(args, scenario):
        sched.add_request(request)
    decode_steps: list[float] = []
    prefill_steps: list[float] = []
    total = 0.0
    num_tokens = num_steps = 0
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    gc_was_enabled = gc.isenabled()
    if args.no_gc:
        gc.disable()  # collections run untimed every 64 steps instead
    try:
        while sched.has_unfinished_requests():
            full = sched.num_running == args.max_running
            t0 = clock()
            out = sched.schedule()
            t1 = clock()
            sampled = {s.request_id: [fake_token(s.request)] for s in out.scheduled if s.sample}
            t2 = clock()
            sched.update_from_output(out, sampled)
            t3 = clock()
            step = (t1 - t0) + (t3 - t2)
            total += step
            num_tokens += out.num_batched_tokens
            num_steps += 1
            if full and out.num_batched_tokens == len(out.scheduled) == args.max_running:
                decode_steps.append(step)
            elif out.num_batched_tokens > len(out.scheduled):
                prefill_steps.append(step)
            if args.no_gc and num_steps % 64 == 0:
                gc.collect()
    finally:
        if gc_was_enabled:
            gc.enable()
    mgr = sched.kv_cache_manager
    assert mgr.num_free_blocks == args.num_blocks, "blocks leaked"
    return RunResult(
        decode_steps,
        prefill_steps,
        total,
        num_tokens,
        num_steps,
        mgr.stats.hit_rate,
        sched.num_preemptions,
    )


def median_or_nan(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(runs: list[RunResult]) -> dict[str, float]:
    """Medians over repeats of each run's own medians/totals."""
    return {
        "decode_ms": statistics.median(median_or_nan(r.decode_step_s) for r in runs) * 1e3,
        "prefill_ms": statistics.median(median_or_nan(r.prefill_step_s) for r in runs) * 1e3,
        "us_per_token": statistics.median(r.total_s / r.num_tokens for r in runs) * 1e6,
        "total_s": statistics.median(r.total_s for r in runs),
        "hit_rate": runs[0].hit_rate,
        "decode_steps": len(runs[0].decode_step_s),
        "steps": runs[0].num_steps,
        "preemptions": runs[0].num_preemptions,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=128)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--num-blocks", type=int, default=12_000, help="enough for max-running requests"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--algos", nargs="+", default=["builtin", "sha256"])
    parser.add_argument("--scenarios", nargs="+", type=int, help="indices into SCENARIOS")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument(
        "--no-gc", action="store_true", help="keep garbage collections out of the timed region"
    )
    parser.add_argument("--profile", action="store_true", help="profile one run and exit")
    return parser.parse_args(argv)


def profile(args: argparse.Namespace, scenario: Scenario, algo: str) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    run_once(args, scenario, algo)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    scenarios = [SCENARIOS[i] for i in args.scenarios] if args.scenarios else SCENARIOS
    if args.profile:
        profile(args, scenarios[0], args.algos[0])
        return
    print(
        f"python {sys.version.split()[0]}; {args.requests} requests, prompt {args.prompt_len}, "
        f"{args.decode_steps} decode steps each, max_num_seqs {args.max_running}, budget "
        f"{args.budget}, block_size {args.block_size}, num_blocks {args.num_blocks}, "
        f"repeats {args.repeats}, clock {args.clock}, gc {'untimed' if args.no_gc else 'on'}"
    )
    columns = [
        "scenario",
        "hash",
        "hit rate",
        "decode step ms",
        "us/req",
        "prefill step ms",
        "us/token",
        "total s",
        "preempt",
    ]
    widths = [15, 8, 9, 15, 8, 16, 9, 8, 8]
    print(
        "".join(
            c.rjust(w) if i > 1 else c.ljust(w)
            for i, (c, w) in enumerate(zip(columns, widths, strict=True))
        )
    )
    for scenario in scenarios:
        runs: dict[str, list[RunResult]] = {algo: [] for algo in args.algos}
        for _ in range(args.repeats):
            for algo in args.algos:  # interleaved, so drift hits both alike
                runs[algo].append(run_once(args, scenario, algo))
        summaries = {algo: summarize(r) for algo, r in runs.items()}
        for algo, s in summaries.items():
            print(
                f"{scenario.name:<15}{algo:<8}{s['hit_rate']:>9.1%}{s['decode_ms']:>15.3f}"
                f"{s['decode_ms'] * 1e3 / args.max_running:>8.2f}{s['prefill_ms']:>16.3f}"
                f"{s['us_per_token']:>9.3f}{s['total_s']:>8.2f}{s['preemptions']:>8}"
            )
        if {"builtin", "sha256"} <= summaries.keys():
            b, s = summaries["builtin"], summaries["sha256"]
            print(
                f"{'':<15}{'sha/bi':<8}{'':>9}{s['decode_ms'] / b['decode_ms']:>14.2f}x{'':>8}"
                f"{s['prefill_ms'] / b['prefill_ms']:>15.2f}x"
                f"{s['us_per_token'] / b['us_per_token']:>8.2f}x{s['total_s'] / b['total_s']:>7.2f}x"
            )


if __name__ == "__main__":
    main()
