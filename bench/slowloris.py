"""Slow clients against a fresh server: does a normal request still get through, and how long
does the server hold a connection that trickles its headers?

    .venv/bin/python -m bench.slowloris [--connections 1000] [--duration 40] [-- SERVER FLAGS]

Starts `python -m server` (the default model unless the server flags say otherwise) on
127.0.0.1, measures a normal request (a completion of 8 tokens) unloaded, then opens
`--connections` sockets that each send a request line and then one header byte every
`--interval` seconds. A socket the server closes is opened again at once, so that many stay
open for `--duration` seconds while the normal request is measured again. Prints the
normal request's latency both ways, how long the server held each slow connection (from
its connect to its close) and how many it closed. Issue 29's goal: loaded latency within
2x unloaded, every slow connection closed within 60 s.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.servers import free_port, launch, stop, wait_ready

REQUEST = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


async def _normal_latencies(url: str, count: int, gap_s: float) -> list[float]:
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        for _ in range(count):
            start = time.perf_counter()
            r = await http.post("/v1/completions", json={**REQUEST, "model": model})
            r.raise_for_status()
            out.append(time.perf_counter() - start)
            await asyncio.sleep(gap_s)
    return out


async def _slow_client(host: str, port: int, interval_s: float, held: list[float]) -> None:
    """Forever: connect, send a request line, trickle header bytes until the server closes."""
    while True:
        start = time.monotonic()
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(interval_s)
            continue
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            while True:
                try:
                    data = await asyncio.wait_for(reader.read(1024), interval_s)
                except asyncio.TimeoutError:
                    writer.write(b"a")
                    await writer.drain()
                    continue
                if not data:  # the server closed it
                    held.append(time.monotonic() - start)
                    break
        except (ConnectionError, OSError):
            held.append(time.monotonic() - start)
        finally:
            writer.close()


async def _run(url: str, port: int, args: argparse.Namespace) -> dict[str, object]:
    unloaded = await _normal_latencies(url, args.requests, 0.2)
    held: list[float] = []
    clients = [
        asyncio.create_task(_slow_client("127.0.0.1", port, args.interval, held))
        for _ in range(args.connections)
    ]
    await asyncio.sleep(min(5.0, args.duration / 4))  # let them connect and start trickling
    loaded = await _normal_latencies(url, args.requests, args.duration / args.requests / 2)
    remaining = args.duration - (time.monotonic() - _START)
    await asyncio.sleep(max(0.0, remaining))
    for task in clients:
        task.cancel()
    await asyncio.gather(*clients, return_exceptions=True)
    return {"unloaded": unloaded, "loaded": loaded, "held": held}


_START = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between bytes")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of slow clients")
    parser.add_argument("--requests", type=int, default=10, help="normal requests per phase")
    parser.add_argument("server_flags", nargs="*", help="after --: flags for the server")
    args = parser.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="slowloris-")) / "server.log"
    argv_server = [sys.executable, "-m", "server", "--port", str(port), "--log-level",
                   "warning", *args.server_flags]  # fmt: skip
    proc = launch(argv_server, log)
    try:
        wait_ready(url, proc, 600, log)
        global _START
        _START = time.monotonic()
        result = asyncio.run(_run(url, port, args))
    finally:
        stop(proc)
    unloaded, loaded, held = result["unloaded"], result["loaded"], result["held"]
    assert isinstance(unloaded, list) and isinstance(loaded, list) and isinstance(held, list)
    u50, l50 = statistics.median(unloaded), statistics.median(loaded)
    print(f"server flags: {' '.join(args.server_flags) or '(defaults)'}; log {log}")
    print(f"normal request (8 tokens), median of {args.requests}: unloaded {u50 * 1000:.0f} ms, "
          f"with {args.connections} slow connections {l50 * 1000:.0f} ms ({l50 / u50:.2f}x); "
          f"max {max(unloaded) * 1000:.0f} / {max(loaded) * 1000:.0f} ms")  # fmt: skip
    if held:
        print(f"slow connections closed by the server: {len(held)} in {args.duration:.0f} s; "
              f"held median {statistics.median(held):.1f} s, max {max(held):.1f} s")  # fmt: skip
    else:
        print(f"slow connections closed by the server: none in {args.duration:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
