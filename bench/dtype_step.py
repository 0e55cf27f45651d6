"""Decode-step time of the default model per dtype, backend, quantization and matmul, in turns.

    .venv/bin/python -m bench.dtype_step --batch 1,32 --dtypes float32,bfloat16
    .venv/bin/python -m bench.dtype_step --dtypes bfloat16 --backends sdpa-nocascade,sdpa
    .venv/bin/python -m bench.dtype_step --dtypes bfloat16 --quantizations none,int8 \
        --kernels off,on --batch 1,4,8
    .venv/bin/python -m bench.dtype_step --dtypes bfloat16 --quantizations none,int4,auto
    .venv/bin/python -m bench.dtype_step --dtypes auto --quantizations auto \
        --kv-cache-dtypes auto,int8 --batch 32 --context 2000

One engine per variant, each with `batch` requests of 300 random prompt tokens (or
`--context` tokens, whose prefill is skipped: the runner is bypassed for those steps, the
cache keeps zeros, and a decode step's time does not depend on the cache's values)
decoding; the engines step in turns (6 steps each, 8 rounds) in one process, so a noisy
neighbour slows all of them alike, and the medians are compared as ratios to the first.
This is what `dtype=auto` and the default backend rest on.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.machine import machine_line

PROMPT_TOKENS = 300
ROUNDS, STEPS_PER_TURN = 8, 6


def decoding_engine(
    dtype: str,
    backend: str,
    batch: int,
    quantization: str | None = None,
    seed: int = 0,
    kv_cache_dtype: str = "auto",
    context: int | None = None,
):
    """An engine of `dtype`, attention `backend`, `quantization` and KV cache dtype whose
    `batch` requests are past their prefill (of `context` tokens: skipped, see above)."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    prompt_tokens = context or PROMPT_TOKENS
    config = EngineConfig(
        dtype=dtype,
        attention_backend=backend,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        num_blocks=batch * (prompt_tokens // 16 + 24) + 160,
    )
    engine = LLMEngine(config)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            str(i), [rng.randrange(100, 40000) for _ in range(prompt_tokens)], params
        )
    finish_prefills(engine, rng, 40000, skip=context is not None)
    return engine


def finish_prefills(engine, rng: random.Random, vocab: int, skip: bool) -> None:
    """Step `engine` until every request is past its prompt. `skip`: without running the
    model (random sampled tokens; the cache keeps zeros), as a decode step's time does not
    depend on the cache's values."""
    from engine.model_runner import SampledTokens

    execute = engine.core.runner.execute
    if skip:
        engine.core.runner.execute = lambda out: {
            s.request_id: SampledTokens([rng.randrange(100, vocab)], None)
            for s in out.scheduled
            if s.sample
        }
    while any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.core.scheduler.requests.values()
    ):
        engine.step()
    engine.core.runner.execute = execute


def use_torch_ops(engine) -> None:
    """Run this engine's matmuls and small layer ops through torch, not the CPU kernels
    (its attention backend stays as chosen)."""
    import torch.nn.functional as F

    from engine.models.layer_ops import TorchOps
    from engine.models.linear import Linear

    model = engine.core.model
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.kernel = None
    model.head_kernel = None
    model.ops = TorchOps(model.attn_backend, F.silu)  # torch's layer ops
    engine.core.runner.decode_stack = None  # which would run the kernels' layers


def step_medians_ms(
    engines: dict, rounds: int = ROUNDS, steps: int = STEPS_PER_TURN
) -> dict[str, float]:
    """Median ms per `engine.step()` of each engine; the engines step in turns, so drift
    hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            for _ in range(steps):
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
    parser.add_argument("--kv-cache-dtypes", default="auto", help="e.g. auto,int8")
    parser.add_argument("--context", type=int, help="prompt tokens per request, not prefilled")
    parser.add_argument(
        "--kernels",
        default="on",
        help="on,off: off runs matmuls and a layer's small ops through torch (A/B; the "
        "attention backend is --backends)",
    )
    args = parser.parse_args(argv)
    print(machine_line())
    variants = [
        (d, b, q, k, kv)
        for d in args.dtypes.split(",")
        for b in args.backends.split(",")
        for q in args.quantizations.split(",")
        for k in args.kernels.split(",")
        for kv in args.kv_cache_dtypes.split(",")
    ]
    for batch in (int(b) for b in args.batch.split(",")):
        engines = {}
        for d, b, q, k, kv in variants:
            name = f"{d}/{b}/{q}/kernels-{k}/kv-{kv}"
            engines[name] = decoding_engine(d, b, batch, q, kv_cache_dtype=kv, context=args.context)
            if k == "off":
                use_torch_ops(engines[name])
        medians = step_medians_ms(engines)
        base = next(iter(medians.values()))
        cells = ", ".join(f"{d} {m:.1f} ms ({base / m:.2f}x)" for d, m in medians.items())
        print(f"batch {batch}: {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
