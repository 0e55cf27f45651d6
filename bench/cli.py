"""`pagedserve bench` (load-test one server), `bench compare` (several servers) and `bench
soak` (one server under a long abusive load): the commands, their flags in bench/arguments.py.

Standard library only at import: `pagedserve serve` builds the whole parser, so it imports
this file but nothing heavy; each command's work is imported in `run`.
`python -m bench ...` is `pagedserve bench ...`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from bench.arguments import add_arguments, load_config_from_args, workload_spec

HELP = "load-test an OpenAI-compatible server (`compare`: several servers; see bench/README.md)"


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "compare":
        from bench.compare import run_compare

        return run_compare(args)
    if args.bench_command == "soak":
        from bench.soak import run_soak_command

        return run_soak_command(args)
    return run_bench(args)


def run_bench(args: argparse.Namespace) -> int:
    from bench.plots import plot_points
    from bench.report import write_json
    from bench.runner import load_bench_tokenizer, run_sweep, warm_up

    cfg = load_config_from_args(args, args.base_url, args.model)
    tokenizer = load_bench_tokenizer(args.tokenizer)
    warm_up(cfg, args.warmup)
    points = []
    for name in args.workload:
        spec = workload_spec(args, name)
        for point in run_sweep(cfg, spec, tokenizer, args.concurrency):
            print(json.dumps(point.record), flush=True)
            points.append(point)
    records = [p.record for p in points]
    if args.output:
        write_json(args.output, records)
    if args.plot:
        plot_points(points, args.plot, label_key="workload")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))
