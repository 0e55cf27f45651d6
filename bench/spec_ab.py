"""Speculative decoding on against off in one process: two engines, the same prompts, in
turns, each round's order swapped, so a server's start-up and the machine's drift fall
on both alike.

    .venv/bin/python -m bench.spec_ab [--workload unique,shared-prefix] [--streams 1,16]
        [--num-requests 16] [--prefix-len 500] [--max-tokens 64] [--rounds 6]
        [--speculative ngram] [--model M]

Per workload and stream count: output tok/s of each engine per round (greedy, `ignore_eos`;
`--streams` requests submitted together, the next batch when they are done; one stream:
one request at a time) and the median of the per-round ratios on / off with their range.
A first round of each is a warm-up and not counted (it fills both prefix caches alike).
`bench compare` measures the same through the servers; there each server starts once and
runs after the other, which on a shared machine showed an order effect of 10-15%.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.machine import machine_line
from bench.workloads import WorkloadSpec, build_prompts


def tok_per_s(llm, prompts: list[str], streams: int, max_tokens: int) -> float:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), streams):
        outputs = llm.generate(prompts[i : i + streams], params, use_tqdm=False)
        tokens += sum(len(o.token_ids) for o in outputs)
    return tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--workload", default="unique,shared-prefix")
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument(
        "--prefix-len", type=int, default=500, help="prompt tokens before the question"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--speculative", default="ngram")
    args = parser.parse_args(argv)
    from engine import LLM

    engines = {"off": LLM(args.model), "on": LLM(args.model, speculative=args.speculative)}
    tokenizer = engines["off"].tokenizer
    print(machine_line())
    print(f"speculative {args.speculative} vs off, {args.num_requests} requests of "
          f"{args.max_tokens} tokens, {args.rounds} rounds after a warm-up")  # fmt: skip
    for workload in args.workload.split(","):
        spec = WorkloadSpec(workload, num_requests=args.num_requests, prefix_len=args.prefix_len)
        prompts = [p.text for p in build_prompts(spec, tokenizer)]
        for streams in (int(s) for s in args.streams.split(",")):
            runs: dict[str, list[float]] = {"off": [], "on": []}
            for round_ in range(args.rounds + 1):
                order = ("off", "on") if round_ % 2 else ("on", "off")
                for name in order:
                    rate = tok_per_s(engines[name], prompts, streams, args.max_tokens)
                    if round_:  # round 0 warms both up
                        runs[name].append(rate)
            ratios = sorted(on / off for on, off in zip(runs["on"], runs["off"], strict=True))
            print(f"{workload} streams {streams}: off {[round(r, 1) for r in runs['off']]} "
                  f"on {[round(r, 1) for r in runs['on']]} tok/s; on/off median "
                  f"{statistics.median(ratios):.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f})",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
