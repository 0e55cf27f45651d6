"""Server RSS over rounds of varied prompt lengths (issue 29, item 4).

    .venv/bin/python -m bench.rss_rounds [--rounds 5] [--requests 120] [-- SERVER FLAGS]

Starts a fresh `pagedserve serve --num-blocks 512` on a free port on 127.0.0.1 (the server
flags after `--` are added; `--env KEY=VALUE` sets the server's environment), then runs
`--rounds` rounds of `--requests` completions, `--concurrency` at a time: prompts of a
uniform 1-700 words and `max_tokens` uniform 1-8, drawn from `--seed` (every run and every
round sends different prompts, the same run to run). After each round it prints the VmRSS
of the server's process tree in MiB; at the end, the growth from round 2 to the last.
Issue 29's goal: under 20 MB. Each request has a timeout, and the whole run `--timeout`.

As a soak, `--minutes 30 --plot rss.png`: rounds until that many minutes have passed, the
RSS also sampled every `--sample-every` seconds while the load runs, printed as a table
and plotted (matplotlib, the `bench` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.machine import machine_line
from bench.servers import free_port, launch, stop, wait_ready

_TEXT = (
    "the of and to in is was that for it with as on be at by this had not are but from or "
    "have an they which one you were her all she there would their we him been has when who "
    "will more no if out so said what up its about into than them can only other new some "
    "could time these two may then do first any my now such like our over man me even most "
    "made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another know "
    "while last might us great old year off come since against go came right used take three"
)
WORDS = _TEXT.split()  # common English words: prompts of ~1.3 tokens a word


def tree_rss_mib(pid: int) -> float:
    """VmRSS of a process and its descendants, MiB."""
    pids, total_kib = [pid], 0
    while pids:
        p = pids.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        total_kib += next(
            (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS")), 0
        )
        children = subprocess.run(["pgrep", "-P", str(p)], capture_output=True, text=True)
        pids.extend(int(c) for c in children.stdout.split())
    return total_kib / 1024


class RssSampler(threading.Thread):
    """Samples the server tree's RSS every `every_s` seconds while the load runs."""

    def __init__(self, pid: int, every_s: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.every_s = pid, every_s
        self.samples: list[tuple[float, float]] = []  # (seconds since start, MiB)
        self._done = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while True:
            self.samples.append((time.monotonic() - start, tree_rss_mib(self.pid)))
            if self._done.wait(self.every_s):
                return

    def stop(self) -> list[tuple[float, float]]:
        self._done.set()
        self.join()
        return self.samples


def make_requests(rng: random.Random, count: int, max_words: int) -> list[dict[str, object]]:
    return [
        {
            "prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, max_words))),
            "max_tokens": rng.randint(1, 8),
            "temperature": 0,
        }
        for _ in range(count)
    ]


async def run_round(url: str, bodies: list[dict[str, object]], concurrency: int) -> int:
    """Sends `bodies`, `concurrency` at a time; the number that did not answer 200."""
    queue = list(reversed(bodies))
    failed = 0

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal failed
        while queue:
            body = queue.pop()
            try:
                r = await http.post("/v1/completions", json=body)
                failed += r.status_code != 200
            except httpx.HTTPError:
                failed += 1

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        for body in bodies:
            body["model"] = model
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=120, help="per round")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-words", type=int, default=700)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds idle before RSS")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server")
    parser.add_argument("--label", default="", help="printed with the results")
    parser.add_argument("--minutes", type=float, default=0, help="a soak: overrides --rounds")
    parser.add_argument("--sample-every", type=float, default=60, help="seconds, with --minutes")
    parser.add_argument("--plot", type=Path, help="with --minutes: a PNG of RSS per sample")
    parser.add_argument("server_flags", nargs="*", help="after --: flags for the server")
    args = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="rss-rounds-")) / "server.log"
    server = Path(sys.executable).with_name("pagedserve")
    argv_server = [str(server), "serve", "--num-blocks", "512", "--port", str(port),
                   "--log-level", "warning", *args.server_flags]  # fmt: skip
    rng = random.Random(args.seed)
    soak_s = args.minutes * 60
    deadline = time.monotonic() + max(args.timeout, soak_s + 300)
    print(machine_line())
    proc = launch(argv_server, log, env)
    rss: list[float] = []
    sampler = RssSampler(proc.pid, args.sample_every)
    try:
        wait_ready(url, proc, 600, log)
        print(f"{args.label or 'server'}: {' '.join(argv_server[1:])} env {env or '{}'}")
        print(f"  started: {tree_rss_mib(proc.pid):,.0f} MiB")
        if soak_s:
            sampler.start()
        soak_end = time.monotonic() + soak_s
        for i in range(10**9 if soak_s else args.rounds):
            if soak_s and time.monotonic() > soak_end:
                break
            if time.monotonic() > deadline:
                print(f"  stopped: --timeout {args.timeout:.0f} s reached")
                break
            bodies = make_requests(rng, args.requests, args.max_words)
            start = time.monotonic()
            remaining = deadline - start
            failed = asyncio.run(asyncio.wait_for(run_round(url, bodies, args.concurrency),
                                                  remaining))  # fmt: skip
            time.sleep(args.settle)
            rss.append(tree_rss_mib(proc.pid))
            print(f"  round {i + 1}: {rss[-1]:,.0f} MiB ({time.monotonic() - start:.0f} s, "
                  f"{failed} failed)", flush=True)  # fmt: skip
    finally:
        samples = sampler.stop() if sampler.is_alive() else []
        stop(proc)
    if samples:
        _report_soak(samples, args)
    summary = " / ".join(f"{r:,.0f}" for r in rss)
    growth = f"{rss[-1] - rss[1]:+.0f} MiB" if len(rss) > 2 else "n/a"
    print(f"  RSS per round {summary} MiB; round 2 to {len(rss)}: {growth}; log {log}")
    return 0


def _report_soak(samples: list[tuple[float, float]], args: argparse.Namespace) -> None:
    print("  minute  RSS MiB")
    for t, r in samples:
        print(f"  {t / 60:6.1f}  {r:7,.0f}")
    after_warmup = [r for t, r in samples if t >= 120]  # from minute 2, as rounds from 2
    if after_warmup:
        print(f"  from minute 2 to the end: {after_warmup[-1] - after_warmup[0]:+.0f} MiB "
              f"(min {min(after_warmup):,.0f}, max {max(after_warmup):,.0f})")  # fmt: skip
    if args.plot:
        from bench.plots import plot_rss

        title = f"server RSS, {args.minutes:g} min of prompts of 1-{args.max_words} words"
        print(f"  plot: {plot_rss(samples, args.plot, title)}")


if __name__ == "__main__":
    sys.exit(main())
