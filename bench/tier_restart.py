"""TTFT of a request sharing a long prefix after a restart: warm KV tier against cold.

    .venv/bin/python -m bench.tier_restart                   # 2,000-token prefix, 3 rounds
    .venv/bin/python -m bench.tier_restart --prefix-len 4000 --server-args "--kv-cache-dtype int8"

Each round: a server with `--kv-offload-bytes` on an empty tier answers a request of the
prefix plus a question (the cold TTFT: the whole prompt prefilled), is stopped (SIGTERM:
its pool's cached blocks are saved to the tier), started again on the same tier, and
answers the prefix plus another question (the warm TTFT: the prefix's blocks come back
from the file, only the question is prefilled). TTFT is the time to the first streamed
token; the medians over the rounds are compared as a ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.machine import machine_line
from bench.servers import free_port, launch, stop, wait_ready
from bench.workloads import question_text, text_of_tokens


def ttft_s(url: str, prompt: str) -> tuple[float, int]:
    """(seconds to the first streamed token, prompt tokens the server served from cache)."""
    body = {"prompt": prompt, "max_tokens": 4, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start, first, cached = time.perf_counter(), None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            if first is None:
                first = time.perf_counter() - start
            if '"prompt_tokens_details"' in line:
                usage = json.loads(line[6:]).get("usage") or {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert first is not None, "no token streamed"
    return first, cached


def serve_once(argv: list[str], log: Path, prompt: str) -> tuple[float, int]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = launch([*argv, "--port", str(port)], log)
    try:
        wait_ready(url, proc, 600, log)
        return ttft_s(url, prompt)
    finally:
        stop(proc, timeout_s=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-len", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tier", default="2GiB", help="--kv-offload-bytes")
    parser.add_argument("--server-args", default="", help="extra `pagedserve serve` flags")
    args = parser.parse_args(argv)
    from engine import LLM  # noqa: F401  (the default model converted once, outside the timing)
    from engine.loader import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(None))
    print(machine_line())
    cold, warm = [], []
    for r in range(args.rounds):
        rng = random.Random(r)
        prefix = text_of_tokens(tokenizer, rng, args.prefix_len)
        first = prefix + question_text(tokenizer, rng, 0, 16)
        second = prefix + question_text(tokenizer, rng, 1, 16)
        cache = Path(tempfile.mkdtemp(prefix="tier-restart-"))
        try:
            server = [sys.executable, "-m", "server", "--log-level", "warning",
                      "--kv-offload-bytes", args.tier, "--cache-dir", str(cache / "models"),
                      *shlex.split(args.server_args)]  # fmt: skip
            cold_s, cold_cached = serve_once(server, cache / "cold.log", first)
            warm_s, warm_cached = serve_once(server, cache / "warm.log", second)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        cold.append(cold_s)
        warm.append(warm_s)
        print(f"round {r}: cold TTFT {cold_s * 1e3:.0f} ms ({cold_cached} cached tokens), "
              f"after a restart {warm_s * 1e3:.0f} ms ({warm_cached} cached)", flush=True)  # fmt: skip
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"median TTFT: cold {c * 1e3:.0f} ms, warm tier after a restart {w * 1e3:.0f} ms "
          f"({w / c:.2f}x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
