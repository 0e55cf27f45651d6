"""Decode step time on a GPU: SDPA and Triton attention eager, Triton with CUDA graphs; the
weight-read floor; and the Triton paged decode attention's bandwidth.

    python3 -m bench.gpu_step --model DIR --out gpu_step.json [--batch 1,64]
        [--context 2000] [--steps 6] [--rounds 8] [--dtype bfloat16] [--device auto]

The figures, one line each after the machine's (and the GPU's), and in the JSON at --out:

- HBM bandwidth: a 1 GiB device-to-device copy, timed with CUDA events over 20 copies after
  a warm-up, counted as read + write (2 x 1 GiB per copy). Null on CPU.
- The floor: the weight bytes a decode step reads (every parameter of the model, less an
  untied embedding table, of which a step reads only its batch's rows) over that bandwidth:
  no decode step can be faster. Each step time is also given as "x the floor".
- Decode step time, median ms per `engine.step()` (which ends with the sampled token ids on
  the host, so it includes the GPU's work), per batch size and mode: `sdpa-eager`
  (attention_backend sdpa, enforce_eager), `triton-eager` (triton, enforce_eager) and
  `triton-graphs` (triton; on CUDA the engine captures CUDA graphs of the decode forward at
  start-up: `graphs_captured`). Each engine holds `batch` requests of `--context` random
  prompt tokens whose prefill is skipped (as bench/dtype_step.py does: a decode step's
  time does not depend on the cache's values); the three engines of a batch size step in
  turns (`--steps` steps each, `--rounds` rounds) after a warm-up, so drift hits them
  alike, and are freed before the next batch size's. The ratios are speed-ups of
  triton-graphs over triton-eager and over sdpa-eager (above 1: graphs faster).
- Triton paged decode attention: one layer's `TritonBackend` call for the largest batch,
  `--context` tokens each, the model's head layout and dtype, block_size 16, shuffled
  block tables, timed with `triton.testing.do_bench_cudagraph` (median; the first GPU
  run timed it eagerly with `do_bench`). Its bytes are the K and V
  rows it must read (batch x context x KV heads x head_dim x itemsize x 2); GB/s and the
  fraction of the copy bandwidth (the goal: 0.7 or more) follow.

Three engines of the largest batch are in memory at once: each its weights plus
batch x (context / 16 + 24) + 160 KV blocks.

On a machine without CUDA it runs the same code on CPU (Triton through its interpreter,
`TRITON_INTERPRET=1`; no bandwidth, so no floor): that is how tests/bench/test_gpu_step.py
checks it with a tiny model.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.dtype_step import finish_prefills, step_medians_ms
from bench.machine import machine_line

MODES = {  # name -> (attention_backend, enforce_eager)
    "sdpa-eager": ("sdpa", True),
    "triton-eager": ("triton", True),
    "triton-graphs": ("triton", False),
}
BLOCK_SIZE = 16
WARMUP_STEPS = 3
SPARE_TOKENS = 8  # each request's room past the timed steps: none finishes while timed
COPY_BYTES, COPY_REPS = 1 << 30, 20


@dataclass(frozen=True)
class ModelShape:
    """What the attention benchmark and the floor need of the model."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    weight_bytes: int  # read by one decode step

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelShape:
        arch = model.arch  # this rank's share of the heads (engine/models/layers.py)
        heads = (arch.num_heads, arch.num_kv_heads, arch.head_dim)
        return cls(*heads, model.dtype, weight_bytes(model))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one decode step reads: every parameter (shared ones once), but
    not an untied embedding table, of which the step reads only its tokens' rows."""
    skip = set() if model.arch.tie_word_embeddings else {id(model.embed_tokens)}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)


# -- the engines and their decode steps -----------------------------------------------------


def decoding_engine(
    model: str, mode: str, batch: int, context: int, dtype: str, device: str, decode_tokens: int
):
    """An engine in `mode` whose `batch` requests of `context` random prompt tokens are past
    their (skipped) prefill, with room to decode `decode_tokens` more each."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    backend, enforce_eager = MODES[mode]
    config = EngineConfig(
        model=model,
        dtype=dtype,
        device=device,
        attention_backend=backend,
        enforce_eager=enforce_eager,
        max_num_seqs=batch,
        # fixed, no memory profiling; twice a request's blocks, as a windowed model's groups
        # each hold some and a window's a whole step's chunk besides (max_blocks_held)
        num_blocks=2 * batch * (context // BLOCK_SIZE + 24) + 1024,
        max_model_len=context + decode_tokens + BLOCK_SIZE,
    )
    engine = LLMEngine(config)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True)
    vocab = min(engine.core.vocab_size, 40000)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(100, vocab) for _ in range(context)], params)
    finish_prefills(engine, rng, vocab, skip=True)
    return engine


def timed_steps_ms(engines: dict, rounds: int, steps: int) -> dict[str, float]:
    """`step_medians_ms` after a warm-up, checking that every request ran throughout."""
    for engine in engines.values():
        for _ in range(WARMUP_STEPS):  # Triton compiles its kernels on their first launch
            engine.step()
    medians = step_medians_ms(engines, rounds, steps)
    for name, engine in engines.items():
        if len(engine.core.scheduler.running) != len(engine.core.scheduler.requests):
            raise RuntimeError(f"{name}: requests finished or waited while timed")
    return medians


def free(engines: dict, device: torch.device) -> None:
    """Drop the engines and give their memory (weights, KV cache, graphs) back."""
    for engine in engines.values():
        engine.shutdown()
    engines.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- bandwidth ------------------------------------------------------------------------------


def copy_bandwidth_gbps(device: torch.device) -> float | None:
    """HBM bandwidth (GB/s) of a 1 GiB device-to-device copy, read + write; None on CPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(COPY_REPS):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / COPY_REPS
    del src, dst
    torch.cuda.empty_cache()
    return 2 * COPY_BYTES / seconds / 1e9


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median ms of `fn`: on CUDA `triton.testing.do_bench_cudagraph` (calls replayed from
    one CUDA graph, as a decode step's are: a kernel of tens of us timed eagerly is partly
    the host's launch time), a few timed calls on CPU."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench_cudagraph(fn, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def decode_inputs(batch: int, context: int, heads: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device):  # fmt: skip
    """q, the K/V caches and the metadata of one decode-only step: `batch` requests of
    `context` tokens each in shuffled blocks."""
    from engine.attention.metadata import AttentionMetadata

    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [order[r * per_seq : (r + 1) * per_seq] for r in range(batch)]
    kv_shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache = torch.randn(kv_shape, dtype=dtype, device=device)
    v_cache = torch.randn(kv_shape, dtype=dtype, device=device)
    q = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, BLOCK_SIZE, device)
    return q, k_cache, v_cache, meta


def attention_figures(
    shape: ModelShape, batch: int, context: int, device: torch.device, hbm_gbps: float | None
) -> dict:
    """The Triton backend's decode attention for one layer: `batch` requests of `context`
    tokens in shuffled blocks; ms, GB/s of K/V read and its fraction of `hbm_gbps`."""
    from engine.attention.triton_paged import TritonBackend

    q, k_cache, v_cache, meta = decode_inputs(batch, context, shape.num_heads,
                                              shape.num_kv_heads, shape.head_dim,
                                              shape.dtype, device)  # fmt: skip
    backend = TritonBackend(shape.num_heads, shape.num_kv_heads)
    backend.prepare(meta)
    scale = shape.head_dim**-0.5
    ms = time_ms(lambda: backend(q, k_cache, v_cache, meta, scale), device)
    itemsize = torch.empty((), dtype=shape.dtype).element_size()
    kv_bytes = batch * context * shape.num_kv_heads * shape.head_dim * itemsize * 2
    gbps = kv_bytes / (ms / 1e3) / 1e9
    return {
        "batch": batch,
        "context": context,
        "num_heads": shape.num_heads,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "ms": ms,
        "gbps": gbps,
        "fraction_of_hbm": gbps / hbm_gbps if hbm_gbps else None,
    }


# -- the run --------------------------------------------------------------------------------


def gpu_line(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    import triton

    name = torch.cuda.get_device_name(device)
    return f"{name}, torch {torch.__version__}, triton {triton.__version__}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--batch", default="1,64", help="decode batch sizes (default 1,64)")
    parser.add_argument("--context", type=int, default=2000, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=6, help="steps per engine per turn")
    parser.add_argument("--rounds", type=int, default=8, help="turns per engine")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine import EngineConfig  # loads no Triton kernel: TRITON_INTERPRET is set below

    device = EngineConfig(model=args.model, device=args.device).resolve_device()
    if device.type == "cpu":  # read when a kernel is defined: before triton_paged loads
        os.environ.setdefault("TRITON_INTERPRET", "1")
    batches = [int(b) for b in args.batch.split(",")]
    decode_tokens = WARMUP_STEPS + args.rounds * args.steps + SPARE_TOKENS
    result: dict = {"machine": machine_line(), "gpu": gpu_line(device), "model": args.model}
    result |= {"dtype": args.dtype, "steps": [], "ratios": []}
    print(result["machine"])
    if result["gpu"]:
        print(result["gpu"])

    hbm = result["hbm_gbps"] = copy_bandwidth_gbps(device)
    copy = f"{hbm:.4g} GB/s (1 GiB copy, read + write)" if hbm else "not measured (not CUDA)"
    print(f"HBM bandwidth: {copy}", flush=True)
    shape: ModelShape | None = None
    floor_ms: float | None = None
    for batch in batches:
        engines = {
            mode: decoding_engine(
                args.model, mode, batch, args.context, args.dtype, args.device, decode_tokens
            )
            for mode in MODES
        }
        if shape is None:
            shape = ModelShape.of(next(iter(engines.values())).core.model)
            floor_ms = shape.weight_bytes / (hbm * 1e9) * 1e3 if hbm else None
            result["weight_bytes"], result["floor_ms"] = shape.weight_bytes, floor_ms
            floor = f"{floor_ms:.3f} ms" if floor_ms else "n/a"
            print(f"floor: {shape.weight_bytes / 1e9:.3f} GB of weights per step -> {floor}")
        medians = timed_steps_ms(engines, args.rounds, args.steps)
        for mode, ms in medians.items():
            captured = engines[mode].core.runner.graphs is not None
            x_floor = ms / floor_ms if floor_ms else None
            entry = {"batch": batch, "mode": mode, "median_ms": ms, "graphs_captured": captured}
            result["steps"].append(entry | {"x_floor": x_floor})
            note = f", {x_floor:.1f}x the floor" if x_floor else ""
            graphs = ", graphs captured" if captured else ""
            print(f"batch {batch} {mode}: {ms:.3f} ms/step{note}{graphs}")
        ratios = {
            "batch": batch,
            "graphs_vs_triton_eager": medians["triton-eager"] / medians["triton-graphs"],
            "graphs_vs_sdpa_eager": medians["sdpa-eager"] / medians["triton-graphs"],
        }
        result["ratios"].append(ratios)
        print(
            f"batch {batch}: triton-graphs {ratios['graphs_vs_triton_eager']:.2f}x as fast as "
            f"triton-eager, {ratios['graphs_vs_sdpa_eager']:.2f}x as fast as sdpa-eager",
            flush=True,
        )
        free(engines, device)

    assert shape is not None
    att = result["attention"] = attention_figures(shape, max(batches), args.context, device, hbm)
    fraction = att["fraction_of_hbm"]
    heads = f"{shape.num_heads}/{shape.num_kv_heads} heads x {shape.head_dim}"
    of_hbm = f", {fraction:.0%} of the HBM bandwidth" if fraction else ""
    print(
        f"triton decode attention, batch {att['batch']}, context {att['context']}, {heads}: "
        f"{att['ms']:.3f} ms, {att['gbps']:.4g} GB/s{of_hbm}"
    )
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
