"""Prefill steps of short queries over cached prefixes, in one engine, with the cpu-paged
backend's `KERNEL_MAX_QUERY` alternating: 1 (every multi-token query through a gather and
SDPA, as before the kernel took them) against 64 (a kernel row per token).

    .venv/bin/python -m bench.prefill_rows --model /tmp/smol/smollm2-135m.Q4_0.gguf \
        --requests 32 --new-tokens 16

Two prefixes of 496 tokens are prefilled once; each round then adds `--requests` requests,
each a prefix plus `--new-tokens` tokens of its own, and times the one step that prefills
them all, under each setting in turn (so drift hits both); medians and every step's time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.machine import machine_line

PREFIX_TOKENS = 496  # whole 16-token blocks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    print(machine_line())

    import engine.attention.cpu_paged as cpu_paged
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, num_blocks=args.requests * 4 + 200))
    scheduler = engine.core.scheduler
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 40000) for _ in range(PREFIX_TOKENS)] for _ in range(2)]
    once = SamplingParams(max_tokens=2, temperature=0)
    for i, prefix in enumerate(prefixes):
        engine.add_request(f"prefix{i}", prefix + [5, 6], once)
    while scheduler.requests:
        engine.step()
    settings = {"SDPA": 1, "kernel rows": 64}
    times: dict[str, list[float]] = {name: [] for name in settings}
    count = 0
    for _ in range(args.rounds):
        for name, limit in settings.items():
            cpu_paged.KERNEL_MAX_QUERY = limit
            for i in range(args.requests):
                question = [rng.randrange(100, 40000) for _ in range(args.new_tokens)]
                engine.add_request(f"r{count}", prefixes[i % 2] + question, once)
                count += 1
            start = time.perf_counter()
            engine.step()  # every request's new tokens in one step
            times[name].append(time.perf_counter() - start)
            while scheduler.requests:
                engine.step()
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    steps = "; ".join(f"{name} {[round(t * 1e3) for t in ts]}" for name, ts in times.items())
    print(f"{args.requests} requests x {args.new_tokens} new tokens over cached prefixes: "
          f"prefill step SDPA {medians['SDPA']:.0f} ms, kernel rows {medians['kernel rows']:.0f} "
          f"ms ({medians['SDPA'] / medians['kernel rows']:.2f}x); steps: {steps}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
