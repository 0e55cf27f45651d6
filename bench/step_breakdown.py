"""Where a batched decode step of a GGUF spends its time: the whole step against its
parts, each timed alone on the step's own shapes (the four projections of one layer and
its paged attention, times the number of layers).

    .venv/bin/python -m bench.step_breakdown --model /tmp/standins/1b-standin.Q4_K_M.gguf \
        --batch 8,32 --context 496

Requests share two prefixes of `--context` tokens and add 16 of their own, as the
shared-prefix workload does; their prefill is skipped (a decode step's time does not depend
on the cache's values). A part timed alone finds its weights in cache, so the parts' sum
can miss the memory time of a batch-1 step; from a few rows on the step is arithmetic and
the split is what a profile of the native stack would say. "rest" is the step less the
parts: the layer ops, the head, sampling and the engine's own work.
"""

from __future__ import annotations

import argparse
import random

import torch

from bench.dtype_step import finish_prefills
from bench.ggml_kernels import median_seconds
from bench.machine import machine_line

PROJECTIONS = ("qkv", "o", "gate_up", "down")


def median_ms(fn, repeat: int = 7) -> float:
    return median_seconds(fn, repeat) * 1e3


def breakdown(model: str, batch: int, context: int) -> str:
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.kernels import ggml_kernels

    engine = LLMEngine(EngineConfig(model=model, num_blocks=batch * (context // 16 + 4) + 160))
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 40000) for _ in range(context)] for _ in range(2)]
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    for i in range(batch):
        own = [rng.randrange(100, 40000) for _ in range(16)]
        engine.add_request(str(i), prefixes[i % 2] + own, params)
    finish_prefills(engine, rng, 40000, skip=True)
    stack = engine.core.runner.decode_stack
    if stack is None:
        raise SystemExit("this model's steps take no decode stack here (see the start-up line)")
    native, seen = stack.native, {}

    class Recorder:  # the stack's arguments of one step, to replay its attention
        def forward(self, *args):
            seen["args"] = args
            return native.forward(*args)

    stack.native = Recorder()
    engine.step()
    step = median_ms(engine.step)
    stack.native = native
    _, _, _, kv_caches, _, tables, seq_lens = seen["args"]
    model_ = engine.core.model
    arch, layers = model_.arch, model_.layers
    kernels = ggml_kernels()
    parts = {}
    for name, linear in zip(PROJECTIONS, layers[0].linears(), strict=True):
        x = torch.randn(batch, linear.method.in_features)
        weights = linear.method.ggml
        parts[name] = median_ms(lambda x=x, w=weights: kernels.ggml_linear(x, *w)) * len(layers)
    k_cache, v_cache = kv_caches[0]
    # q comes in the caches' dtype (bf16 where the CPU has AVX512-BF16), float32 beside int8.
    q_dtype = k_cache.dtype if k_cache.is_floating_point() else torch.float32
    q = torch.randn(batch, arch.num_heads, arch.head_dim, dtype=q_dtype)
    parts["attention"] = median_ms(lambda: kernels.paged_decode_attention(
        q, k_cache, v_cache, tables, seq_lens, arch.head_dim**-0.5)) * len(layers)  # fmt: skip
    parts["rest"] = step - sum(parts.values())
    cells = ", ".join(f"{name} {ms:.1f} ms ({ms / step:.0%})" for name, ms in parts.items())
    return f"batch {batch}, context {context}+16: step {step:.1f} ms = {cells}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", default="8,32")
    parser.add_argument("--context", type=int, default=496)
    args = parser.parse_args(argv)
    print(machine_line())
    for batch in (int(b) for b in args.batch.split(",")):
        print(breakdown(args.model, batch, args.context), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
