"""How fast are deeply nested bodies refused? (issue 29: 100,000 levels, a 400 in under 50 ms)

    .venv/bin/python -m bench.hostile [--depth 100000] [--tries 20] [-- SERVER FLAGS]

Starts a fresh server on the default model (127.0.0.1, a free port), then posts to every
JSON route a body whose `prompt` / message content / `tokens` nests `--depth` lists (and
then objects) deep, `--tries` times each, and prints each status and the median and worst
time to the answer, against a normal small request's time measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.machine import machine_line
from bench.servers import free_port, launch, stop, wait_ready

ROUTES = {  # where each route's body takes the nested value
    "/v1/completions": ('{"model": "m", "max_tokens": 1, "prompt": ', "}"),
    "/v1/chat/completions": ('{"model": "m", "messages": [{"role": "user", "content": ', "}]}"),
    "/tokenize": ('{"model": "m", "prompt": ', "}"),
    "/detokenize": ('{"model": "m", "tokens": ', "}"),
}


def nested(depth: int, kind: str) -> str:
    return ("[" * depth + "]" * depth) if kind == "lists" else ('{"a":' * depth + "1" + "}" * depth)


def timed(http: httpx.Client, route: str, body: bytes, tries: int) -> tuple[set[int], list[float]]:
    statuses, times = set(), []
    for _ in range(tries):
        start = time.perf_counter()
        r = http.post(route, content=body, headers={"content-type": "application/json"})
        times.append(time.perf_counter() - start)
        statuses.add(r.status_code)
    return statuses, times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=100_000)
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("server_flags", nargs="*", help="after --: flags for the server")
    args = parser.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="hostile-")) / "server.log"
    server = Path(sys.executable).with_name("pagedserve")
    argv_server = [str(server), "serve", "--port", str(port), "--log-level", "warning",
                   *args.server_flags]  # fmt: skip
    print(machine_line())
    proc = launch(argv_server, log, {})
    try:
        wait_ready(url, proc, 600, log)
        with httpx.Client(base_url=url, timeout=60) as http:
            small = b'{"model": "m", "prompt": "hi"}'
            _, base = timed(http, "/tokenize", small, args.tries)
            print(f"a small /tokenize: median {statistics.median(base) * 1e3:.1f} ms")
            for route, (head, tail) in ROUTES.items():
                for kind in ("lists", "objects"):
                    body = (head + nested(args.depth, kind) + tail).encode()
                    statuses, times = timed(http, route, body, args.tries)
                    print(f"{route} {args.depth:,} nested {kind} ({len(body):,} bytes): "
                          f"status {sorted(statuses)}, median {statistics.median(times) * 1e3:.1f}"
                          f" ms, worst {max(times) * 1e3:.1f} ms")  # fmt: skip
    finally:
        stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
