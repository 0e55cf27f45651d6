"""Start to healthy and resident memory: pagedserve vs llama-server on the same GGUF.

    .venv/bin/python -m bench.startup /tmp/standins/1b-standin.Q4_K_M.gguf \\
        --llama-server /tmp/llama-build/bin/llama-server --cache-dir /tmp/startup-cache

Each server alone, with the same KV budget (`--context` tokens: pagedserve
`--num-blocks context/16 --max-model-len context`, llama-server `-c context -np 1`): the
seconds from launch to a 200 on /health, then the RSS of the server's process tree after
one 100-word completion. pagedserve runs first with a fresh `--cache-dir` (the GGUF never
seen: its config and tokenizer are read), then warm `--rounds` times (the median, and the
range). `--phases` then names what a warm start spends: each phase timed in a fresh
process, in the order `pagedserve serve` runs them (`PHASES`), the median of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.machine import machine_line
from bench.servers import free_port


def tree_rss_gib(pid: int) -> float:
    """VmRSS of a process and its children, GiB."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    total_kib = 0
    for p in [pid, *(int(c) for c in children.stdout.split())]:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        total_kib += next(int(line.split()[1]) for line in status.splitlines()
                          if line.startswith("VmRSS"))  # fmt: skip
    return total_kib / 2**20


def measure(argv: list[str], port: int, timeout_s: float = 600) -> tuple[float, float]:
    """(seconds to healthy, RSS GiB after one request) of a server started with `argv`."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    try:
        while True:
            if proc.poll() is not None or time.perf_counter() - start > timeout_s:
                raise RuntimeError(f"{argv[0]} did not become healthy")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        healthy = time.perf_counter() - start
        body = json.dumps({"model": "m", "prompt": "hello " * 100, "max_tokens": 16}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})  # fmt: skip
        urllib.request.urlopen(request, timeout=timeout_s).read()
        return healthy, tree_rss_gib(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


# A warm start's phases, in `pagedserve serve`'s order; each snippet runs after the ones
# before it, in one fresh process, and is timed alone.
PHASES = (
    ("the interpreter and pagedserve's command line (fastapi, uvicorn)", "import server.cli"),
    ("torch", "import torch"),
    ("the server and engine modules",
     "import server.app, server.async_engine, server.shutdown, engine.core"),
    ("the model's config (config.json, the GGUF's header)",
     "from engine.resolved_config import ResolvedConfig\n"
     "resolved = ResolvedConfig.resolve(config)"),
    ("transformers and the tokenizer",
     "from engine.loader import load_tokenizer\ntokenizer = load_tokenizer(resolved.model_dir)"),
    ("the engine: weights, repacking, kernels, KV cache",
     "core = engine.core.EngineCore(resolved, tokenizer=tokenizer)"),
    ("the app", "app = server.app.build_app(server.async_engine.AsyncEngine(core))"),
)  # fmt: skip


def phases_script(gguf: Path, context: int, cache_dir: Path) -> str:
    """A program printing, as JSON, the seconds of each of `PHASES` (the first from the
    process's start, read from /proc)."""
    lines = ["import time, json, os",
             "start = time.clock_gettime(time.CLOCK_MONOTONIC) - (",
             "    time.clock_gettime(time.CLOCK_BOOTTIME) - int(open('/proc/self/stat').read()"
             ".split(')')[1].split()[19]) / os.sysconf('SC_CLK_TCK'))",
             "seconds = []"]  # fmt: skip
    for i, (_, code) in enumerate(PHASES):
        lines += code.split("\n")
        if i == 2:
            lines += ["from engine.config import EngineConfig",
                      f"config = EngineConfig(model={str(gguf)!r}, num_blocks={context // 16}, "
                      f"max_model_len={context}, cache_dir={str(cache_dir)!r})"]  # fmt: skip
        lines += ["seconds.append(time.clock_gettime(time.CLOCK_MONOTONIC) - start)"]
    lines += ["print(json.dumps([b - a for a, b in zip([0.0] + seconds, seconds)]))",
              "os._exit(0)"]  # fmt: skip
    return "\n".join(lines)


def measure_phases(gguf: Path, context: int, cache_dir: Path, rounds: int) -> list[list[float]]:
    script = phases_script(gguf, context, cache_dir)
    runs = []
    for _ in range(rounds):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             check=True, timeout=600)  # fmt: skip
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--llama-server", type=Path, help="llama-server (else pagedserve only)")
    parser.add_argument("--cache-dir", type=Path, required=True, help="emptied first")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=1, help="warm starts of each (median)")
    parser.add_argument("--phases", action="store_true", help="then time a warm start's phases")
    args = parser.parse_args(argv)
    shutil.rmtree(args.cache_dir, ignore_errors=True)
    print(machine_line())
    print(f"{args.gguf.name}, KV budget {args.context} tokens each\n")
    print("| server | start to healthy | min-max | RSS after a request |")
    print("|---|---:|---:|---:|")
    argv_of = lambda port: [sys.executable, "-m", "server", "--model", str(args.gguf),  # noqa: E731
                            "--port", str(port), "--num-blocks", str(args.context // 16),
                            "--max-model-len", str(args.context), "--cache-dir",
                            str(args.cache_dir), "--served-model-name", "m"]  # fmt: skip
    port = free_port()
    print(row("pagedserve, first start", [measure(argv_of(port), port)]))
    print(row("pagedserve, warm", [measure(argv_of(p), p) for p in rounds_of_ports(args.rounds)]))
    if args.llama_server is not None:
        runs = [measure([str(args.llama_server), "-m", str(args.gguf), "--port", str(p), "-c",
                         str(args.context), "-np", "1", "-a", "m"], p)
                for p in rounds_of_ports(args.rounds)]  # fmt: skip
        print(row("llama-server", runs))
    if args.phases:
        runs = measure_phases(args.gguf, args.context, args.cache_dir, max(args.rounds, 3))
        print("\n| phase of a warm start (fresh process each) | seconds, median |")
        print("|---|---:|")
        for i, (name, _) in enumerate(PHASES):
            print(f"| {name} | {statistics.median(r[i] for r in runs):.2f} |")
        total = statistics.median(sum(r) for r in runs)
        print(f"| all of the above | {total:.2f} |")
    return 0


def rounds_of_ports(rounds: int) -> list[int]:
    return [free_port() for _ in range(rounds)]


def row(label: str, runs: list[tuple[float, float]]) -> str:
    seconds = [s for s, _ in runs]
    return (
        f"| {label} | {statistics.median(seconds):.2f} s | {min(seconds):.2f}-"
        f"{max(seconds):.2f} s | {statistics.median(r for _, r in runs):.2f} GiB |"
    )


if __name__ == "__main__":
    raise SystemExit(main())
