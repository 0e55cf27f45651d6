"""This checkout against another (e.g. the previous main) in turns: engine step and server.

    git worktree add /tmp/prev main~3
    .venv/bin/python -m bench.checkout_ab --other /tmp/prev --rounds 3

Each round runs both checkouts, alternating which goes first, with this venv:
- the engine step: one process per checkout (its own `engine` on the path) builds the
  offline `LLMEngine` on the default model (or `--model`), puts `--batch` requests over 4 shared
  500-token prefixes past their prefill, and times `STEPS` decode steps (median), for
  each batch size;
- the server: `python -m bench compare --servers pagedserve` run from each checkout's
  directory (so its `server` package serves), on the shared-prefix workload at each
  `--concurrency`, output tok/s and ITL p50.
`--model PATH` (an HF directory or a .gguf, e.g. bench/standin.py's 1B stand-in) is what both
checkouts load in both parts; the other checkout is only given options it knows
(`EngineConfig(model=...)`, `bench compare --model`), which older mains have.
The other checkout builds its CPU kernels into its own extension cache (`.torch_extensions`
in its directory): one cache for both would rebuild each checkout's kernels at every start.
Ratios are this checkout's figure over the other's, median over the rounds (a step-time
ratio under 1 and a throughput ratio over 1 mean this checkout is faster). Refactors are
checked with it: the engine's speed must not move.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.machine import machine_line
from engine.default_model import DEFAULT_MODEL_NAME

HERE = Path(__file__).resolve().parents[1]
STEPS = 20

# Runs inside a child whose working directory is the checkout: it imports that `engine`.
STEP_SNIPPET = r"""
import json, random, statistics, sys, time
from engine import EngineConfig, LLMEngine, SamplingParams
batches = [int(b) for b in sys.argv[1].split(",")]
model = sys.argv[2] or None
rng = random.Random(0)
prefixes = [[rng.randrange(100, 40000) for _ in range(500)] for _ in range(4)]
engine = LLMEngine(EngineConfig(model=model, max_num_seqs=max(batches),
                                 max_num_batched_tokens=4096))
result = {}
for batch in batches:
    params = SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0.0)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, prefixes[i % 4] + [rng.randrange(100, 40000) for _ in range(16)],
                           params)
    for _ in range(20):  # the prefills, then a few decode steps to settle
        engine.step()
    times = []
    for _ in range(__STEPS__):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    result[batch] = statistics.median(times) * 1000
    engine.abort_request(ids)
print("RESULT " + json.dumps(result))
""".replace("__STEPS__", str(STEPS))


def checkout_env(checkout: Path) -> dict[str, str]:
    """The environment a child of `checkout` runs in: its packages first on the path, and
    for a checkout other than this one its own kernel build cache (the two checkouts'
    kernel sources may differ, and torch keys its cache by name, not by source)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    if checkout != HERE:
        env["TORCH_EXTENSIONS_DIR"] = str(checkout / ".torch_extensions")
    return env


def engine_steps(checkout: Path, batches: str, model: str | None = None) -> dict[str, float]:
    """Median decode-step ms per batch size, from a child running `checkout`'s engine on
    `model` (None: the default model)."""
    env = checkout_env(checkout)
    out = subprocess.run(
        [sys.executable, "-c", STEP_SNIPPET, batches, model or ""],
        cwd=checkout, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def server_figures(
    checkout: Path, concurrency: str, num_requests: int, model: str | None = None,
    workload: str = "shared-prefix", serve_args: str = "",
) -> dict[str, dict]:  # fmt: skip
    """Output tok/s and ITL p50 per concurrency, from `bench compare` run in `checkout`
    serving `model` (None: the default model) with `serve_args` on `workload`."""
    env = checkout_env(checkout)
    model_args = ["--model", model] if model else []
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [sys.executable, "-m", "bench", "compare", "--servers", "pagedserve",
             f"--pagedserve-args={serve_args}", "--workload", workload, "--concurrency", concurrency,
             "--num-requests", str(num_requests), "--no-plots", "--no-progress",
             "--out", out, *model_args],
            cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        records = json.loads(next(Path(out).glob("**/results.json")).read_text())
    return {
        str(r["concurrency"]): {"tok_s": r["output_throughput"], "itl_p50": r["itl_ms"]["p50"]}
        for r in records
        if r.get("server") == "pagedserve"
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--other", type=Path, required=True, help="the other checkout's directory")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", default="1,32", help="engine step batch sizes")
    ap.add_argument("--concurrency", default="1,32", help="server concurrencies")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--model", metavar="PATH", help="HF model dir or .gguf both checkouts "
                    "load, engine step and server (default: the embedded default model)")  # fmt: skip
    args = ap.parse_args()
    # Absolute: the children run in the checkouts' directories.
    model = str(Path(args.model).expanduser().resolve()) if args.model else None
    print(f"{machine_line()}, model {Path(model).name if model else DEFAULT_MODEL_NAME}",
          flush=True)  # fmt: skip
    checkouts = {"this": HERE, "other": args.other.resolve()}
    steps: dict[str, list[dict]] = {"this": [], "other": []}
    serve: dict[str, list[dict]] = {"this": [], "other": []}
    for round_ in range(args.rounds):
        order = ["this", "other"] if round_ % 2 == 0 else ["other", "this"]
        for name in order:
            if not args.skip_step:
                steps[name].append(engine_steps(checkouts[name], args.batch, model))
                print(f"round {round_ + 1} {name}: step ms {steps[name][-1]}", flush=True)
            if not args.skip_server:
                serve[name].append(
                    server_figures(checkouts[name], args.concurrency, args.num_requests, model)
                )
                print(f"round {round_ + 1} {name}: server {serve[name][-1]}", flush=True)
    print("\n| figure | this | other | ratio (median of rounds) |\n|---|---|---|---|")
    for batch in args.batch.split(",") if not args.skip_step else []:
        row = [(t[batch], o[batch]) for t, o in zip(steps["this"], steps["other"], strict=True)]
        _row(f"engine step b={batch} (ms)", row)
    for conc in args.concurrency.split(",") if not args.skip_server else []:
        for key, label in (("tok_s", "out tok/s"), ("itl_p50", "ITL p50 ms")):
            pairs = zip(serve["this"], serve["other"], strict=True)
            _row(f"server c={conc} {label}", [(t[conc][key], o[conc][key]) for t, o in pairs])


def _row(label: str, pairs: list[tuple[float, float]]) -> None:
    this = statistics.median(p[0] for p in pairs)
    other = statistics.median(p[1] for p in pairs)
    ratio = statistics.median(p[0] / p[1] for p in pairs)
    print(f"| {label} | {this:.2f} | {other:.2f} | {ratio:.3f}x |")


if __name__ == "__main__":
    main()
