"""Run a workload against one server at one or more concurrency levels: records + samples.

Level i of a sweep uses the workload seed `seed + i`, so each level's prompts are new to the
server (a prefix cache warmed by the previous level would flatter it), while two servers
measured with the same options get exactly the same prompts at each level.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.loadgen import LoadConfig, RequestResult, run_load
from bench.report import load_average, summarize, ttft_samples
from bench.server_metrics import metrics_delta, scrape
from bench.workloads import (
    PREFIX_WORKLOADS,
    Conversation,
    Prompt,
    Tokenizer,
    WorkloadSpec,
    build_conversations,
    build_prompts,
    count_tokens,
)


@dataclass
class SweepPoint:
    record: dict[str, Any]
    ttfts: list[float]  # seconds, successful streamed requests only (for the CDF plot)


def load_bench_tokenizer(path: str | None = None) -> Any:
    """The tokenizer prompts are measured with: `path` (an HF dir or a .gguf), else the
    default model's. Imported here: transformers is only needed once a run starts."""
    from engine.loader import load_tokenizer, resolve_model_dir

    return load_tokenizer(resolve_model_dir(path))


def build_work(spec: WorkloadSpec, tokenizer: Tokenizer) -> list[Prompt] | list[Conversation]:
    if spec.name == "multi-turn":
        return build_conversations(spec, tokenizer)
    return build_prompts(spec, tokenizer)


def _prompt_counter(tokenizer: Tokenizer):
    def count(result: RequestResult) -> int:
        prompt = result.prompt
        if isinstance(prompt, list):  # chat: the messages' text (the template not counted)
            prompt = "".join(str(m.get("content", "")) for m in prompt)
        return count_tokens(tokenizer, prompt or "")

    return count


def warm_up(cfg: LoadConfig, num_requests: int = 1) -> None:
    """A few short requests nothing in the workload shares: first-call costs are not timed."""
    if num_requests < 1:
        return
    warm = dataclasses.replace(cfg, max_tokens=min(cfg.max_tokens, 8), progress=False)
    prompts = [Prompt(f"Warm-up request {i}: say hello.", i) for i in range(num_requests)]
    asyncio.run(run_load(warm, prompts, desc="warm-up"))


def run_point(
    cfg: LoadConfig, spec: WorkloadSpec, tokenizer: Tokenizer, **context: Any
) -> SweepPoint:
    """One load run, with the server's /metrics scraped around it when it has them."""
    work = build_work(spec, tokenizer)
    before = scrape(cfg.base_url)
    load_before = load_average()
    desc = f"{context.get('server', '')} {spec.name} c={cfg.concurrency or 'inf'}".strip()
    run = asyncio.run(run_load(cfg, work, desc=desc))
    after = scrape(cfg.base_url)
    record = summarize(
        run,
        _prompt_counter(tokenizer),
        **context,
        workload=spec.name,
        endpoint=cfg.endpoint,
        concurrency=cfg.concurrency,
        request_rate=cfg.request_rate,
        max_tokens=cfg.max_tokens,
        prefix_len=spec.prefix_len,
        num_prefixes=spec.num_prefixes if spec.name in PREFIX_WORKLOADS else None,
        stream=cfg.stream,
        seed=spec.seed,
    )
    record["server_metrics"] = metrics_delta(before, after)
    record["load_avg_1m"] = load_before
    record["load_avg_1m_after"] = load_average()
    return SweepPoint(record, ttft_samples(run))


def run_sweep(
    cfg: LoadConfig,
    spec: WorkloadSpec,
    tokenizer: Tokenizer,
    levels: Sequence[int | None],
    **context: Any,
) -> list[SweepPoint]:
    points = []
    for i, level in enumerate(levels):
        point_cfg = dataclasses.replace(cfg, concurrency=level)
        point_spec = dataclasses.replace(spec, seed=spec.seed + i)
        points.append(run_point(point_cfg, point_spec, tokenizer, **context))
        _print_progress_line(points[-1].record)
    return points


def _print_progress_line(r: dict[str, Any]) -> None:
    print(
        f"# {r.get('server') or r['workload']}: {r['workload']} c={r['concurrency'] or 'inf'} "
        f"{r['requests']} ok {r['errors']} err, {r['output_throughput']:.1f} out tok/s, "
        f"TTFT p50 {r['ttft_ms']['p50']} ms",
        file=sys.stderr,
        flush=True,
    )
