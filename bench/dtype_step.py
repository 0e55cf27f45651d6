"""Decode-step time of the default model per dtype, backend, quantization and matmul, in turns.

    .venv/bin/python -m bench.dtype_step --batch 1,32 --dtypes float32,bfloat16
    .venv/bin/python -m bench.dtype_step --dtypes bfloat16 --backends sdpa-nocascade,sdpa
    .venv/bin/python -m bench.dtype_step --dtypes bfloat16 --quantizations none,int8 \
        --kernels off,on --batch 1,4,8
    .venv/bin/python -m bench.dtype_step --dtypes bfloat16 --quantizations none,int4,auto

One engine per variant, each with `batch` requests of 300 random prompt tokens
decoding; the engines step in turns (6 steps each, 8 rounds) in one process, so a noisy
neighbour slows all of them alike, and the medians are compared as ratios to the first.
This is what `dtype=auto` and the default backend rest on.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.compare import machine_line

PROMPT_TOKENS = 300
ROUNDS, STEPS_PER_TURN = 8, 6


def decoding_engine(
    dtype: str, backend: str, batch: int, quantization: str | None = None, seed: int = 0
):
    """An engine of `dtype`, attention `backend` and `quantization` whose `batch` requests
    are past their prefill."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    config = EngineConfig(
        dtype=dtype,
        attention_backend=backend,
        quantization=quantization,
        num_blocks=batch * 40 + 160,
    )
    engine = LLMEngine(config)
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


def use_torch_ops(engine) -> None:
    """Run this engine's matmuls and small layer ops through torch, not the CPU kernels
    (its attention backend stays as chosen)."""
    from engine.models.linear import Linear

    model = engine.model
    for module in model.modules():
        if isinstance(module, Linear):
            module.kernel = None
    model.head_kernel = model.fused_ops = None


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
    parser.add_argument("--backends", default="auto")
    parser.add_argument(
        "--quantizations", default="none", help="e.g. none,int8,int4,auto (auto: the default)"
    )
    parser.add_argument(
        "--kernels",
        default="on",
        help="on,off: off runs matmuls and a layer's small ops through torch (A/B; the "
        "attention backend is --backends)",
    )
    args = parser.parse_args(argv)
    print(machine_line())
    variants = [
        (d, b, q, k)
        for d in args.dtypes.split(",")
        for b in args.backends.split(",")
        for q in args.quantizations.split(",")
        for k in args.kernels.split(",")
    ]
    for batch in (int(b) for b in args.batch.split(",")):
        engines = {}
        for d, b, q, k in variants:
            name = f"{d}/{b}/{q}/kernels-{k}"
            engines[name] = decoding_engine(d, b, batch, q)
            if k == "off":
                use_torch_ops(engines[name])
        medians = step_medians_ms(engines)
        base = next(iter(medians.values()))
        cells = ", ".join(f"{d} {m:.1f} ms ({base / m:.2f}x)" for d, m in medians.items())
        print(f"batch {batch}: {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
