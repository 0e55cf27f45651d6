"""The cost of batch invariance: `--deterministic` (every call through the kernels that
compute a row alone) against the default (each call's fastest kernel), in turns.

    .venv/bin/python -m bench.deterministic --rounds 3

Each round, in alternating order:
- the server: `bench compare --servers pagedserve` with each mode's flag, output tok/s and
  ITL p50 at each `--concurrency`, on each `--workload` (shared-prefix: the project's
  standard, mostly cache hits and decode; unique: every prompt cold, so its prefill shows);
- the prefill: one engine per mode in one process, the time of a cold prompt of each
  `--prefill-lens` tokens (median of 3), where invariance costs most: every token's
  attention through the paged kernel instead of SDPA's blocked prefill, and (bf16
  activations) every projection through the int8 dot products instead of the bf16 GEMM.
Ratios are on's figure over off's, median over the rounds (throughput under 1, time over
1: invariance costs that much). Measure on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.checkout_ab import HERE
from bench.checkout_ab import server_figures as checkout_figures
from bench.machine import machine_line

MODES = ("on", "off")  # --deterministic, and without it


def server_figures(
    mode: str, workload: str, concurrency: str, num_requests: int, model: str | None
) -> dict[str, dict]:
    """Output tok/s and ITL p50 per concurrency from `bench compare`, served in ``mode``."""
    flag = "--deterministic" if mode == "on" else ""
    return checkout_figures(HERE, concurrency, num_requests, model, workload, flag)


def prefill_seconds(engines: dict, lens: list[int], salt: int) -> dict[str, dict[int, float]]:
    """Per mode, per prompt length: the median time of a cold prompt's prefill (one output
    token), the modes' engines in turns. ``salt`` makes each round's prompts new."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    times: dict[str, dict[int, list[float]]] = {m: {n: [] for n in lens} for m in engines}
    for rep in range(3):
        for n in lens:
            prompt = [100 + (salt * 7919 + rep * 104729 + n + i * 31) % 30000 for i in range(n)]
            for mode, engine in engines.items():
                start = time.perf_counter()
                engine.generate([prompt], params, use_tqdm=False)
                times[mode][n].append(time.perf_counter() - start)
    return {m: {n: statistics.median(t) for n, t in per.items()} for m, per in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workload", default="shared-prefix,unique")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prefill-lens", default="500,2000")
    ap.add_argument("--model", metavar="PATH", help="an HF directory or .gguf (default: the "
                    "embedded default model)")  # fmt: skip
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--out", type=Path, help="also write the rounds as JSON here")
    args = ap.parse_args()
    print(machine_line())
    workloads = [w for w in args.workload.split(",") if w]
    lens = [int(n) for n in args.prefill_lens.split(",") if n]
    from engine import LLM

    engines = {m: LLM(args.model, deterministic=m == "on", max_num_batched_tokens=max(lens))
               for m in MODES}  # fmt: skip
    rounds = []
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        record: dict = {"prefill_s": prefill_seconds({m: engines[m] for m in order}, lens, r)}
        if not args.skip_server:
            for workload in workloads:
                record[workload] = {m: server_figures(m, workload, args.concurrency,
                                                      args.num_requests, args.model)
                                    for m in order}  # fmt: skip
        rounds.append(record)
        print(f"round {r + 1}: {json.dumps(record)}", flush=True)
    report(rounds, workloads if not args.skip_server else [], lens, args.concurrency)
    if args.out:
        args.out.write_text(json.dumps({"machine": machine_line(), "rounds": rounds}, indent=1))


def report(rounds: list[dict], workloads: list[str], lens: list[int], concurrency: str) -> None:
    """The medians over rounds of on / off."""

    def median_ratio(path: tuple) -> str:
        def figure(record: dict, mode: str) -> float:
            value = record[path[0]][mode]
            for key in path[1:]:
                value = value[key]
            return value

        ratios = [figure(r, "on") / figure(r, "off") for r in rounds]
        return f"{statistics.median(ratios):.3f} ({', '.join(f'{x:.3f}' for x in ratios)})"

    for n in lens:
        print(f"prefill {n} tokens, time on/off: {median_ratio(('prefill_s', n))}")
    for workload in workloads:
        for c in concurrency.split(","):
            tok = median_ratio((workload, c, "tok_s"))
            itl = median_ratio((workload, c, "itl_p50"))
            print(f"{workload} c={c}: output tok/s on/off {tok}; ITL p50 on/off {itl}")


if __name__ == "__main__":
    main()
