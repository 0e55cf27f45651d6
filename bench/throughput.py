"""Offline throughput: pagedserve's `LLM.generate` against transformers' batched `generate`.

Same model, dtype, prompts and output length, measured in one run:
- output tok/s on a shared-prefix set (4 prefixes of ~500 tokens, 64 prompts)
  and on a unique set (64 prompts of the same length, nothing shared);
- prefill time of the shared-prefix set with prefix caching on vs off;
- the unique set with caching on vs off, run twice each in turns (the cost of
  caching at 0% hits);
- decode step time at batch 1 and 64 against this machine's floors: the larger
  of weight bytes / memory read bandwidth and FLOPs / the matmul rate at that
  many rows (the L3 cache holds part of the weights, so a step can beat the
  bandwidth floor slightly). The batch-64 step has unique 500-token contexts.

    .venv/bin/python -m bench.throughput                 # bfloat16, ~10 min on 2 cores
    .venv/bin/python -m bench.throughput --dtype float32
    .venv/bin/python -m bench.throughput --quick         # fewer prompts and tokens
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass

import torch

from engine import LLM, SamplingParams

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "by",
    "at",
    "from",
    "that",
    "this",
    "be",
    "or",
    "an",
    "which",
    "have",
    "not",
    "system",
    "prompt",
    "context",
    "document",
    "retrieval",
    "answer",
    "question",
    "model",
    "token",
    "cache",
    "block",
    "memory",
    "server",
    "request",
    "batch",
    "prefix",
    "layer",
    "attention",
    "value",
    "key",
    "query",
    "head",
    "vector",
    "paged",
    "kernel",
]


@dataclass
class Workload:
    shared: list[list[int]]
    unique: list[list[int]]


class Report(dict):
    """Prints each figure as soon as it is measured: a long run shows its progress."""

    def __setitem__(self, key: str, value: object) -> None:
        super().__setitem__(key, value)
        print(f"{key}: {round(value, 3) if isinstance(value, float) else value}", flush=True)

    def update(self, other: dict) -> None:
        for key, value in other.items():
            self[key] = value


def make_workload(tokenizer, n: int, prefix_tokens: int, num_prefixes: int, seed: int) -> Workload:
    rng = random.Random(seed)

    def text_of(num_tokens: int) -> list[int]:
        words = " ".join(rng.choice(WORDS) for _ in range(num_tokens * 2))
        return tokenizer.encode(words)[:num_tokens]

    prefixes = [text_of(prefix_tokens) for _ in range(num_prefixes)]
    shared = [prefixes[i % num_prefixes] + text_of(16) for i in range(n)]
    unique = [text_of(prefix_tokens) + text_of(16) for _ in range(n)]
    return Workload(shared, unique)


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run_engine(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds to generate max_tokens for every prompt (fresh prefix cache)."""
    llm.engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seconds, outs = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    assert all(len(o.token_ids) == max_tokens for o in outs)
    return seconds


def run_transformers(
    model, prompts: list[list[int]], max_tokens: int, batch: int, pad: int
) -> float:
    """Seconds for transformers' batched generate, left-padded batches of `batch` prompts."""
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            group = prompts[i : i + batch]
            width = max(map(len, group))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=pad,
            )
    return time.perf_counter() - start


def read_bandwidth_gbs() -> float:
    """This machine's memory read bandwidth (GB/s): summing 1 GiB, beyond the 260 MB L3."""
    big = torch.ones(2**30 // 4, dtype=torch.float32)
    rates = []
    for _ in range(5):
        seconds, _ = timed(big.sum)
        rates.append(big.numel() * 4 / seconds / 1e9)
    return statistics.median(rates)


def matmul_gflops(llm: LLM, rows: int) -> float:
    """Matmul rate (GFLOP/s) of ``rows`` tokens through the MLP's gate/up shape, model dtype."""
    dtype = llm.engine.core.dtype
    hidden = llm.engine.core.config.hf_config.hidden_size
    inter = llm.engine.core.config.hf_config.intermediate_size
    a = torch.randn(rows, hidden, dtype=dtype)
    w = torch.randn(hidden, 2 * inter, dtype=dtype)  # the model's [in, out] layout
    rates = []
    for _ in range(9):
        seconds, _ = timed(lambda: a @ w)
        rates.append(2 * rows * hidden * 2 * inter / seconds / 1e9)
    return statistics.median(rates)


def decode_step_seconds(llm: LLM, batch: int, context: int) -> float:
    """Median engine step while `batch` requests decode at about `context` tokens."""
    eng = llm.engine
    eng.reset_prefix_cache()
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(
            f"decode-{batch}-{i}", [rng.randrange(100, 20000) for _ in range(context)], params
        )
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.core.scheduler.running)
        or eng.core.scheduler.num_waiting
    ):
        eng.step()
    times = []
    while eng.has_unfinished_requests():
        seconds, _ = timed(eng.step)
        times.append(seconds)
    return statistics.median(times[:-1] or times)


def model_bytes_and_flops(llm: LLM) -> tuple[int, int]:
    params = sum(p.numel() for p in llm.engine.core.model.parameters())
    size = sum(p.numel() * p.element_size() for p in llm.engine.core.model.parameters())
    return size, 2 * params


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="16 prompts, 32 tokens: a smoke run")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.max_tokens = 16, 32

    llm = LLM(dtype=args.dtype)
    work = make_workload(llm.tokenizer, args.num_prompts, args.prefix_tokens, 4, seed=0)
    out_tokens = args.num_prompts * args.max_tokens
    report = Report(dtype=args.dtype, prompts=args.num_prompts, max_tokens=args.max_tokens)

    shared_s = run_engine(llm, work.shared, args.max_tokens)
    report["pagedserve_shared_tok_s"] = out_tokens / shared_s

    # Prefill only (1 output token): caching on vs off.
    no_cache = LLM(dtype=args.dtype, enable_prefix_caching=False)
    prefill_on = run_engine(llm, work.shared, 1)
    prefill_off = run_engine(no_cache, work.shared, 1)
    report["prefill_shared_caching_on_s"] = prefill_on
    report["prefill_shared_caching_off_s"] = prefill_off
    report["prefill_speedup_caching"] = prefill_off / prefill_on

    # The cost of caching at 0% hits: unique prompts, on and off in turns (on, off, off,
    # on) so that drift in the machine's speed hits both alike.
    unique_s = run_engine(llm, work.unique, args.max_tokens)
    unique_off_s = run_engine(no_cache, work.unique, args.max_tokens)
    unique_off_s += run_engine(no_cache, work.unique, args.max_tokens)
    unique_s += run_engine(llm, work.unique, args.max_tokens)
    del no_cache
    unique_s, unique_off_s = unique_s / 2, unique_off_s / 2
    report["pagedserve_unique_tok_s"] = out_tokens / unique_s
    report["unique_caching_off_tok_s"] = out_tokens / unique_off_s
    report["unique_caching_on_vs_off"] = unique_off_s / unique_s

    bandwidth = read_bandwidth_gbs()
    report["read_bandwidth_gbs"] = bandwidth
    size, flops_per_token = model_bytes_and_flops(llm)
    for batch in (1, 64):
        step = decode_step_seconds(llm, batch, args.prefix_tokens)
        rate = matmul_gflops(llm, batch)
        mem_floor = size / (bandwidth * 1e9)
        flop_floor = batch * flops_per_token / (rate * 1e9)
        report[f"matmul_gflops_{batch}_rows"] = rate
        report[f"decode_step_ms_b{batch}"] = step * 1e3
        report[f"decode_floor_ms_b{batch}"] = max(mem_floor, flop_floor) * 1e3

    if not args.skip_transformers:
        from engine.loader import load_reference_model, resolve_model_dir

        hf = load_reference_model(resolve_model_dir(None), llm.engine.core.dtype)
        pad = llm.tokenizer.pad_token_id or 0
        hf_shared = run_transformers(hf, work.shared, args.max_tokens, args.hf_batch, pad)
        hf_unique = run_transformers(hf, work.unique, args.max_tokens, args.hf_batch, pad)
        report["transformers_shared_tok_s"] = out_tokens / hf_shared
        report["transformers_unique_tok_s"] = out_tokens / hf_unique
        report["speedup_shared"] = hf_shared / shared_s
        report["speedup_unique"] = hf_unique / unique_s

    print(
        json.dumps(
            {k: round(v, 3) if isinstance(v, float) else v for k, v in report.items()}, indent=2
        )
    )


if __name__ == "__main__":
    main()
