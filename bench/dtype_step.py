"""Decode-step time of the default model in each dtype, measured in turns in one process.

    .venv/bin/python -m bench.dtype_step --batch 1,32 --dtypes float32,bfloat16

One engine per dtype, each with `batch` requests of 300 random prompt tokens decoding;
the engines step in turns (6 steps each, 8 rounds), so a noisy neighbour slows all of
them alike, and the medians are compared as ratios to the first dtype. This is what
`dtype=auto` rests on (engine/config.py).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.compare import machine_line

PROMPT_TOKENS = 300
ROUNDS, STEPS_PER_TURN = 8, 6


def decoding_engine(dtype: str, batch: int, seed: int = 0):
    """An engine of `dtype` whose `batch` requests are past their prefill."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(dtype=dtype, num_blocks=batch * 40 + 160))
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            str(i), [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)], params
        )
    while any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()
    ):
        engine.step()
    return engine


def step_medians_ms(engines: dict) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(ROUNDS):
        for name, engine in engines.items():
            for _ in range(STEPS_PER_TURN):
                start = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args(argv)
    print(machine_line())
    dtypes = args.dtypes.split(",")
    for batch in (int(b) for b in args.batch.split(",")):
        medians = step_medians_ms({d: decoding_engine(d, batch) for d in dtypes})
        base = medians[dtypes[0]]
        cells = ", ".join(f"{d} {m:.1f} ms ({base / m:.2f}x)" for d, m in medians.items())
        print(f"batch {batch}: {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
