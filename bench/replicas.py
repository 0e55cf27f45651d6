"""Prefix-cache-aware routing vs Ray Serve's default routing, 2 engine replicas.

    .venv/bin/python -m bench.replicas [--rounds 2] [--out bench/results/replicas/<date>.md]

The workload has more shared-prefix groups than one replica's KV cache holds: 10 groups
of 512-token prefixes (32 blocks each, 320 blocks) against 192 blocks per replica,
requests cycling through the groups. Routed by prefix, each replica keeps about half the
groups (160 blocks);
routed by Ray Serve's power of two choices, each replica sees every group and its LRU
cache evicts a prefix before it comes round again. Each router runs on a fresh Ray
instance with cold caches and the same requests, in turns; the figures are the runs'
medians: prefix-cache hit rate (prompt tokens found cached, from the replicas' own
counters), TTFT p50 / p99 and output tokens/s, as the load generator measures them.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import LoadConfig, run_load
from bench.machine import cpu_flags_line, machine_line
from bench.report import percentile, publish
from bench.runner import load_bench_tokenizer
from bench.servers import free_port
from bench.workloads import WorkloadSpec, build_prompts

NUM_BLOCKS = 192
SPEC = WorkloadSpec("shared-prefix", num_requests=64, prefix_len=512, num_prefixes=10,
                    question_len=16)  # fmt: skip


def _totals(url: str) -> dict[str, float]:
    """Counters summed over the replicas, and requests served per replica."""
    totals: dict[str, float] = {}
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("pagedserve:prefix_cache_queries_total",
                          "pagedserve:prefix_cache_hits_total"):  # fmt: skip
                totals[s.name] = totals.get(s.name, 0.0) + s.value
            if s.name == "pagedserve:request_success_total":
                key = f"served:{s.labels['replica']}"
                totals[key] = totals.get(key, 0.0) + s.value
    return totals


def run_router(router: str, concurrency: int) -> dict[str, Any]:
    import ray
    from ray import serve

    from server.replicas.deployment import build

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build({"num_replicas": 2, "router": router,
                         "engine": {"num_blocks": NUM_BLOCKS, "max_model_len": 2048}}),
                  name="pagedserve", route_prefix="/")  # fmt: skip
        prompts = build_prompts(SPEC, load_bench_tokenizer())
        cfg = LoadConfig(base_url=url, max_tokens=16, concurrency=concurrency, progress=False)
        time.sleep(2.5)
        before = _totals(url)
        run = asyncio.run(run_load(cfg, prompts))
        time.sleep(2.5)  # the replicas' counters arrive with their stats, about every second
        after = _totals(url)
    finally:
        serve.shutdown()
        ray.shutdown()
    failed = [r.error for r in run.results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    queries = delta["pagedserve:prefix_cache_queries_total"]
    ttfts = [r.ttft for r in run.results if r.ttft is not None]
    return {
        "hit_rate": delta["pagedserve:prefix_cache_hits_total"] / queries if queries else 0.0,
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "tok_s": sum(r.output_tokens for r in run.results) / run.duration,
        "served": sorted(int(v) for k, v in delta.items() if k.startswith("served:")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {"default": [], "prefix": []}
    for _ in range(args.rounds):
        for router in ("default", "prefix"):
            runs[router].append(run_router(router, args.concurrency))
            print(router, runs[router][-1], flush=True)

    def med(router: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[router])

    lines = [
        f"# Replicas: prefix-aware vs default routing ({time.strftime('%Y-%m-%d')})", "",
        f"machine: {machine_line()}", f"CPU flags: {cpu_flags_line()}",
        f"command: python -m bench.replicas {' '.join(argv or sys.argv[1:])}",
        f"workload: {SPEC.num_requests} requests, {SPEC.num_prefixes} prefix groups of "
        f"{SPEC.prefix_len} tokens, concurrency {args.concurrency}, 16 output tokens; "
        f"2 replicas of the default model, {NUM_BLOCKS} KV blocks each; "
        f"medians of {args.rounds} runs per router", "",
        "| router | prefix-cache hit rate | TTFT p50 | TTFT p99 | output tok/s | requests per replica |",
        "| --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for router in ("default", "prefix"):
        served = runs[router][-1]["served"]
        lines.append(
            f"| {router} | {med(router, 'hit_rate'):.1%} | {med(router, 'ttft_p50') * 1e3:.0f} ms"
            f" | {med(router, 'ttft_p99') * 1e3:.0f} ms | {med(router, 'tok_s'):.1f} | {served} |"
        )
    lines += ["", f"prefix / default: hit rate x{med('prefix', 'hit_rate') / max(med('default', 'hit_rate'), 1e-9):.2f}, "
              f"TTFT p50 x{med('prefix', 'ttft_p50') / med('default', 'ttft_p50'):.2f}, "
              f"output tok/s x{med('prefix', 'tok_s') / med('default', 'tok_s'):.2f}"]  # fmt: skip
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
