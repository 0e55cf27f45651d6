"""Whether grammar compiles stall the server, on an idle machine or beside busy processes.

    .venv/bin/python -m bench.compile_stall --busy 2 --rounds 2

Each round starts a fresh server (`python -m server`, this checkout's), beside `--busy`
processes that spin on a core each, and measures:
1. the first stream after /health answers (64 tokens, c=1): its time and its largest
   inter-token gap. The compile thread's warm-up (xgrammar's tokenizer info, built in
   Python) runs then;
2. `bench.structured`'s compile stall: the ITL of 4 unconstrained streams while 8
   requests with large distinct schemas arrive, against the same 8 without schemas.
To compare two checkouts, run it from each (`cd <worktree> && PYTHONPATH=. python -m
bench.compile_stall`) in turns. Written for issue 46: a compile thread at idle priority
held the GIL while the kernel kept it off the cores (server/grammar_compiler.py).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

from bench.loadgen import LoadConfig, run_load
from bench.machine import machine_line
from bench.servers import free_port, launch, stop, wait_ready
from bench.structured import _prompts, bench_compile_stall


def first_stream(url: str, tag: str) -> str:
    started = time.perf_counter()
    cfg = LoadConfig(base_url=url, endpoint="chat", max_tokens=64, concurrency=1,
                     progress=False)  # fmt: skip
    results = asyncio.run(run_load(cfg, _prompts(1, tag))).results
    gaps = [gap for result in results for gap in result.itl]
    return (f"- the first stream after start-up: {time.perf_counter() - started:.2f} s, "
            f"largest inter-token gap {max(gaps) * 1e3:.0f} ms")  # fmt: skip


def one_round(round_: int) -> list[str]:
    port = free_port()
    log = Path("/tmp") / f"pagedserve-compile-stall-{port}.log"
    proc = launch([sys.executable, "-m", "server", "--port", str(port)], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 600, log)
        return [first_stream(url, f"first-{round_}"), *bench_compile_stall(url, 1)]
    finally:
        stop(proc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=0, help="busy processes beside the server")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    print(f"machine: {machine_line()}, {args.busy} busy processes", flush=True)
    spin = [sys.executable, "-c", "while True: pass"]
    busy = [subprocess.Popen(spin) for _ in range(args.busy)]
    try:
        for r in range(args.rounds):
            for line in one_round(r):
                print(f"round {r}: {line}", flush=True)
    finally:
        for proc in busy:
            proc.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
