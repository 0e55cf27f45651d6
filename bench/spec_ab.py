"""Speculative decoding on against off in one process: engines with the same model and
prompts, taking turns batch by batch (the order reversed every batch), so the machine's
drift falls on all alike.

    .venv/bin/python -m bench.spec_ab [--workload unique,shared-prefix] [--streams 1,16]
        [--num-requests 16] [--prefix-len 500] [--max-tokens 64] [--rounds 6]
        [--speculative ngram] [--num-speculative-tokens 8] [--model M]
    .venv/bin/python -m bench.spec_ab --workload copy-edit --streams 1 --num-requests 3 \\
        --max-tokens 300 --num-speculative-tokens 7,8,15    # draft caps against each other

Per workload and stream count: output tok/s of each engine per round (greedy, `ignore_eos`;
`--streams` requests submitted together, each batch run by every engine before the next;
one stream: one request at a time) and, per speculating engine (one per
`--num-speculative-tokens`), the median of the per-round ratios on / off with their range. The copy-edit workload's
prompts go through the model's chat template (a file to return with an edit). A first
round of each is a warm-up and not counted (it fills the prefix caches alike). `bench
compare` measures the same through the servers; there each server starts once and runs
after the other, which on a shared machine showed an order effect of 10-15%.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.machine import machine_line
from bench.workloads import WorkloadSpec, build_prompts

CHAT_WORKLOADS = ("copy-edit",)  # asked as a chat turn, as a user would


def interleaved_rates(
    engines: dict, prompts: list, streams: int, max_tokens: int, reverse: bool
) -> dict[str, float]:
    """Output tok/s of each engine over the same batches of `streams` requests, the engines
    taking turns batch by batch (their order reversed every batch, and for the first batch
    when `reverse`), so the machine's drift within a round falls on all of them alike."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    names = list(engines)
    seconds, tokens = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
    for batch, i in enumerate(range(0, len(prompts), streams)):
        for name in names[::-1] if (batch + reverse) % 2 else names:
            start = time.perf_counter()
            outputs = engines[name].generate(prompts[i : i + streams], params, use_tqdm=False)
            seconds[name] += time.perf_counter() - start
            tokens[name] += sum(len(o.token_ids) for o in outputs)
    return {name: tokens[name] / seconds[name] for name in names}


def workload_prompts(llm, workload: str, args: argparse.Namespace) -> list:
    spec = WorkloadSpec(workload, num_requests=args.num_requests, prefix_len=args.prefix_len)
    texts = [p.text for p in build_prompts(spec, llm.tokenizer)]
    if workload in CHAT_WORKLOADS:
        return [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    return texts


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
    parser.add_argument(
        "--num-speculative-tokens", default=None,
        help="draft caps, comma-separated: one speculating engine each (default: the engine's)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    from engine import LLM

    engines = {"off": LLM(args.model)}
    caps = args.num_speculative_tokens.split(",") if args.num_speculative_tokens else [None]
    for cap in caps:
        fields = {"num_speculative_tokens": int(cap)} if cap else {}
        name = f"on k={cap}" if cap else "on"
        engines[name] = LLM(args.model, speculative=args.speculative, **fields)
    print(machine_line())
    print(f"speculative {args.speculative} vs off, {args.num_requests} requests of "
          f"{args.max_tokens} tokens, {args.rounds} rounds after a warm-up")  # fmt: skip
    names = list(engines)
    for workload in args.workload.split(","):
        prompts = workload_prompts(engines["off"], workload, args)
        for streams in (int(s) for s in args.streams.split(",")):
            runs: dict[str, list[float]] = {name: [] for name in names}
            for round_ in range(args.rounds + 1):
                rates = interleaved_rates(engines, prompts, streams, args.max_tokens, round_ % 2)
                if round_:  # round 0 warms them up
                    for name in names:
                        runs[name].append(rates[name])
            print(f"{workload} streams {streams}: off {[round(r, 1) for r in runs['off']]} tok/s",
                  flush=True)  # fmt: skip
            for name in names[1:]:
                ratios = sorted(on / off for on, off in zip(runs[name], runs["off"], strict=True))
                print(f"  {name} {[round(r, 1) for r in runs[name]]} tok/s; on/off median "
                      f"{statistics.median(ratios):.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f})",
                      flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
