"""Structured outputs: what a grammar costs per step, and whether compiling one stalls anyone.

    .venv/bin/python -m bench.structured [--out bench/results/structured.md]

1. Engine step (in this process, the serving config): the median decode step of B requests
   constrained by a JSON schema vs the same B requests unconstrained, B = 1 and 32, rounds
   in turns. The schema asks for a 64-string array, so no request completes within the
   timed steps and both batches stay full; a second schema bounds those strings'
   length, which xgrammar checks at run time.
2. Server (a fresh `pagedserve serve`): output tokens/s through /v1/chat/completions at
   concurrency 1 and 32, with `response_format` json_schema vs none, same prompts, turns.
3. Compile stall: inter-token latency (ITL) of unconstrained streams at concurrency 4
   while 8 requests with large, distinct schemas arrive one after another (each compiled
   once, ~0.1-0.5 s), against the same 8 requests arriving without a schema.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.loadgen import LoadConfig, RequestResult, make_client, run_load, send_request
from bench.machine import cpu_flags_line, machine_line
from bench.report import percentile, publish
from bench.server_metrics import scrape
from bench.servers import free_port, launch, stop, wait_ready
from bench.workloads import Prompt


def long_list(item: dict[str, Any]) -> dict[str, Any]:
    """An object holding an array of exactly 64 `item`s: longer than any timed run."""
    return {
        "type": "object",
        "properties": {"fruits": {"type": "array", "items": item, "minItems": 64,
                                  "maxItems": 64}},
        "required": ["fruits"],
        "additionalProperties": False,
    }  # fmt: skip


LONG_LIST = long_list({"type": "string"})
# xgrammar checks a bounded string's length token by token at run time (~0.7 ms per row
# and step measured, against ~5 us for a free string), so it is measured apart.
BOUNDED_LIST = long_list({"type": "string", "maxLength": 16})
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "fruits", "schema": LONG_LIST}}


def large_schema(tag: str, num_fields: int = 40) -> dict[str, Any]:
    """A schema of `num_fields` nested objects; `tag` makes it distinct (a cache miss)."""
    item = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 10**6},
            "label": {"type": "string", "maxLength": 40},
            "kind": {"enum": [f"kind_{k}" for k in range(10)]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["id", "label", "kind", "tags", "score"],
        "additionalProperties": False,
    }
    props = {f"field_{tag}_{i}": item for i in range(num_fields)}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}  # fmt: skip


# ------------------------------------------------------------------------ 1. engine step


def engine_step_ms(engine: Any, batch: int, schema: dict | None, steps: int) -> float:
    """Median wall time of `steps` decode steps of `batch` requests (`schema`: constrained)."""
    from engine import SamplingParams, StructuredOutputs

    spec = StructuredOutputs.json_schema(schema) if schema is not None else None
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True,
                            structured_outputs=spec)  # fmt: skip
    ids = [f"step-{spec is not None}-{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        prompt = engine.core.tokenizer.encode(f"Request {i}: list {batch} fruits as JSON.")
        engine.add_request(rid, prompt, params)
    while engine.core.scheduler.num_waiting or any(  # until every prompt is prefilled
        not engine.core.scheduler.requests[r].output_token_ids for r in ids
    ):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.abort_request(ids)
    return statistics.median(times) * 1e3


def bench_engine(batches: tuple[int, ...], steps: int, rounds: int) -> list[str]:
    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig())
    lines = [f"engine: {engine.core.model_name}, {engine.core.compute_summary}"]
    schemas = {"a JSON schema": LONG_LIST, "a JSON schema of maxLength strings": BOUNDED_LIST}
    for batch in batches:
        for label, schema in schemas.items():
            engine_step_ms(engine, batch, schema, 4)  # warm-up: compile, first-call costs
            free, json_ = [], []
            for _ in range(rounds):
                free.append(engine_step_ms(engine, batch, None, steps))
                json_.append(engine_step_ms(engine, batch, schema, steps))
            f, j = statistics.median(free), statistics.median(json_)
            lines.append(f"- batch {batch}: decode step {f:.1f} ms free, {j:.1f} ms with {label}:"
                         f" x{j / f:.3f} ({rounds} rounds of {steps} steps, medians)")  # fmt: skip
    return lines


# ------------------------------------------------------------------- 2. server tokens/s


def _prompts(n: int, tag: str) -> list[Prompt]:
    return [Prompt(f"[{tag} {i}] Name as many fruits as you can, as JSON.", i) for i in range(n)]


def output_tps(url: str, concurrency: int, num: int, constrained: bool, tag: str) -> float:
    extra = {"response_format": RESPONSE_FORMAT} if constrained else {}
    cfg = LoadConfig(base_url=url, endpoint="chat", max_tokens=64, concurrency=concurrency,
                     extra_body=extra, progress=False)  # fmt: skip
    run = asyncio.run(run_load(cfg, _prompts(num, tag)))
    failed = [r.error for r in run.results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return sum(r.output_tokens for r in run.results) / run.duration


def bench_server_tps(url: str, rounds: int) -> list[str]:
    lines = []
    for concurrency, num in ((1, 6), (32, 64)):
        free, json_ = [], []
        for r in range(rounds):
            free.append(output_tps(url, concurrency, num, False, f"free-{concurrency}-{r}"))
            json_.append(output_tps(url, concurrency, num, True, f"json-{concurrency}-{r}"))
        f, j = statistics.median(free), statistics.median(json_)
        lines.append(f"- concurrency {concurrency}: {f:.1f} output tok/s free, {j:.1f} with "
                     f"response_format json_schema: x{j / f:.3f} ({rounds} rounds, medians)")  # fmt: skip
    return lines


# ---------------------------------------------------------------------- 3. compile stall


async def _streams_with_intruders(url: str, schemas: bool, tag: str) -> list[RequestResult]:
    cfg = LoadConfig(base_url=url, endpoint="chat", max_tokens=96, concurrency=4, progress=False)
    load = asyncio.create_task(run_load(cfg, _prompts(12, f"stall-{tag}")))
    await asyncio.sleep(1.0)
    intruder = LoadConfig(base_url=url, endpoint="chat", max_tokens=1, stream=False,
                          ignore_eos=False, progress=False)  # fmt: skip
    async with make_client(intruder, 2) as client:
        for i in range(8):
            body: dict[str, Any] = {"messages": [{"role": "user", "content": f"{tag} {i}"}],
                                    "max_tokens": 1}  # fmt: skip
            if schemas:
                schema = large_schema(f"{tag}{i}")
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "big", "schema": schema}}  # fmt: skip
            result = await send_request(client, intruder, body)
            if not result.ok:
                raise RuntimeError(f"intruder failed: {result.error}")
    return (await load).results


def bench_compile_stall(url: str, rounds: int) -> list[str]:
    itls: dict[bool, list[float]] = {False: [], True: []}
    before = scrape(url) or {}
    for r in range(rounds):
        for schemas in (False, True):
            results = asyncio.run(_streams_with_intruders(url, schemas, f"r{r}{schemas}"))
            itls[schemas].extend(gap for res in results for gap in res.itl)
    after = scrape(url) or {}
    key = "grammar_compile_seconds"
    count = after.get(f"{key}_count", 0) - before.get(f"{key}_count", 0)
    total = after.get(f"{key}_sum", 0) - before.get(f"{key}_sum", 0)
    lines = []
    for schemas, label in ((False, "8 requests without a schema"),
                           (True, "8 requests with large distinct schemas")):  # fmt: skip
        gaps = itls[schemas]
        lines.append(f"- ITL of 4 unconstrained streams while {label} arrive: p50 "
                     f"{percentile(gaps, 50) * 1e3:.1f} ms, p99 {percentile(gaps, 99) * 1e3:.1f} ms "
                     f"({len(gaps)} gaps)")  # fmt: skip
    p99 = {s: percentile(itls[s], 99) for s in itls}
    lines.append(f"- p99 ratio (schemas / none): x{p99[True] / p99[False]:.3f}; the server "
                 f"compiled {count:.0f} grammars, {total / max(count, 1) * 1e3:.0f} ms each "
                 "on average")  # fmt: skip
    return lines


# ----------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per round")
    parser.add_argument("--out", type=Path, help="also write the report here (markdown)")
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args(argv)

    lines = [f"# Structured outputs ({time.strftime('%Y-%m-%d')})", "",
             f"machine: {machine_line()}", f"CPU flags: {cpu_flags_line()}",
             f"command: python -m bench.structured {' '.join(argv or sys.argv[1:])}", ""]  # fmt: skip
    if not args.skip_engine:
        lines += ["## 1. Engine decode step", *bench_engine((1, 32), args.steps, args.rounds), ""]
        print("\n".join(lines), flush=True)
    port = free_port()
    log = Path("/tmp") / f"pagedserve-structured-{port}.log"
    pagedserve = str(Path(sys.executable).with_name("pagedserve"))
    proc = launch([pagedserve, "serve", "--port", str(port)], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 300, log)
        output_tps(url, 4, 4, True, "warm-up")  # first-call costs, the warm-up's grammar
        lines += ["## 2. Server output tokens/s", *bench_server_tps(url, args.rounds), ""]
        lines += ["## 3. Grammar compilation vs unconstrained streams",
                  *bench_compile_stall(url, args.rounds)]  # fmt: skip
    finally:
        stop(proc)
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
