"""Start to healthy and resident memory: pagedserve vs llama-server on the same GGUF.

    .venv/bin/python -m bench.startup /tmp/standins/1b-standin.Q4_K_M.gguf \\
        --llama-server /tmp/llama-build/bin/llama-server --cache-dir /tmp/startup-cache

Each server alone, with the same KV budget (`--context` tokens: pagedserve
`--num-blocks context/16 --max-model-len context`, llama-server `-c context -np 1`): the
seconds from launch to a 200 on /health, then the RSS of the server's process tree after
one 100-word completion. pagedserve runs twice: first with a fresh `--cache-dir` (the
GGUF never seen: its config and tokenizer are read), then warm.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--cache-dir", type=Path, required=True, help="emptied first")
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args(argv)
    shutil.rmtree(args.cache_dir, ignore_errors=True)
    print(machine_line())
    print(f"{args.gguf.name}, KV budget {args.context} tokens each\n")
    print("| server | start to healthy | RSS after a request |")
    print("|---|---:|---:|")
    for label in ("pagedserve, first start", "pagedserve, warm"):
        port = free_port()
        argv_ = [sys.executable, "-m", "server", "--model", str(args.gguf), "--port", str(port),
                 "--num-blocks", str(args.context // 16), "--max-model-len", str(args.context),
                 "--cache-dir", str(args.cache_dir), "--served-model-name", "m"]  # fmt: skip
        seconds, rss = measure(argv_, port)
        print(f"| {label} | {seconds:.2f} s | {rss:.2f} GiB |")
    port = free_port()
    seconds, rss = measure([str(args.llama_server), "-m", str(args.gguf), "--port", str(port),
                            "-c", str(args.context), "-np", "1", "-a", "m"], port)  # fmt: skip
    print(f"| llama-server | {seconds:.2f} s | {rss:.2f} GiB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
