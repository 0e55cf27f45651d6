"""The `pagedserve` command: `serve` (the OpenAI-compatible server) and `generate` (one prompt).

Subcommands are entries of `SUBCOMMANDS`; another package adds its own (e.g. `bench`)
with `register(Subcommand(...))` before `main()` builds the parser. The engine's flags are
server/engine_flags.py's; the value types, server/arg_types.py's.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from server.arg_types import non_negative_float, parse_size, positive_float, positive_int
from server.engine_flags import (
    add_engine_arguments,
    engine_config_from_args,
    engine_fields_from_args,
)
from server.errors import OpenAIError
from server.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_MAX_CONNECTIONS,
    ConnectionLimits,
    clamp_to_open_files,
    raise_open_file_limit,
    uvicorn_config,
)
from server.middleware import DEFAULT_MAX_REQUEST_BODY_BYTES
from server.serving import DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, DEFAULT_MAX_SEQS_PER_REQUEST
from server.shutdown import DEFAULT_DRAIN_TIMEOUT_S
from server.tokens import apply_chat_template, encode_chat, encode_prompt

logger = logging.getLogger("pagedserve")


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS: dict[str, Subcommand] = {}


def register(subcommand: Subcommand) -> None:
    SUBCOMMANDS[subcommand.name] = subcommand


def _load_engine(args: argparse.Namespace, build: Callable[[Any], Any] | None = None) -> Any:
    """``build(config)`` (default: the `LLMEngine`), or None after printing why the engine
    could not start (bad option, bad model)."""
    from engine import LLMEngine

    try:
        return (build or LLMEngine)(engine_config_from_args(args))
    except (ValueError, OSError) as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return None


# ---------------------------------------------------------------------------------- serve


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name",
                   help="the model name clients use (default: the model's name)")  # fmt: skip
    g.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="require `Authorization: Bearer KEY` or `x-api-key: KEY` (default "
                   "$PAGEDSERVE_API_KEY); /health and /metrics stay open")  # fmt: skip
    g.add_argument("--max-waiting-requests", type=positive_int,
                   help="answer 503 + Retry-After while this many requests wait")  # fmt: skip
    g.add_argument("--max-request-body-bytes", type=parse_size,
                   default=DEFAULT_MAX_REQUEST_BODY_BYTES)  # fmt: skip
    g.add_argument("--max-seqs-per-request", type=positive_int,
                   default=DEFAULT_MAX_SEQS_PER_REQUEST,
                   help="answer 400 to a request for more sequences (prompts x n) than this "
                   "(default %(default)s)")  # fmt: skip
    g.add_argument("--pin-system-prompt", action="append", default=[], metavar="TEXT",
                   help="compute this system prompt (as the chat template renders it first "
                   "in a conversation) at start-up and keep its KV blocks resident; "
                   "@FILE reads it from a file; repeatable")  # fmt: skip
    g.add_argument("--pin-prefix", action="append", default=[], metavar="TEXT",
                   help="the same for a raw completions prompt prefix")  # fmt: skip
    g.add_argument("--queue-timeout", type=positive_float,
                   help="seconds a request may wait before its first step; past them it is "
                   "answered 503 queue_timeout (default: no limit; a request's own "
                   "`queue_timeout` field wins)")  # fmt: skip
    g.add_argument("--grammar-compile-timeout", type=positive_float,
                   default=DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
                   help="seconds an output constraint (JSON schema, grammar, regex, tool "
                   "calls) may take to compile, else 400 grammar_compile_timeout, and may "
                   "wait for the compile thread, else 503 + Retry-After "
                   "(default %(default)s)")  # fmt: skip
    g.add_argument("--drain-timeout", type=non_negative_float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="seconds SIGTERM/Ctrl-C lets in-flight requests finish before "
                   "aborting them (default %(default)s; a second signal skips it)")  # fmt: skip
    g = parser.add_argument_group("connections (README, Limits)")
    g.add_argument("--max-connections", type=positive_int, default=DEFAULT_MAX_CONNECTIONS,
                   help="open client connections; past it a new one gets a 503 and is closed "
                   "(default %(default)s, lowered to fit the open-file limit)")  # fmt: skip
    g.add_argument("--max-concurrent-requests", type=positive_int,
                   default=DEFAULT_MAX_CONCURRENT_REQUESTS,
                   help="HTTP requests in flight; past it a 503 + Retry-After "
                   "(default %(default)s)")  # fmt: skip
    g.add_argument("--header-timeout", type=positive_float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="seconds a connection has to send a request's headers, else it is "
                   "closed (slowloris; default %(default)s)")  # fmt: skip
    g.add_argument("--body-timeout", type=positive_float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="seconds after the headers to send the whole body, else the "
                   "connection is closed (default %(default)s)")  # fmt: skip
    g.add_argument("--keep-alive-timeout", type=positive_float,
                   default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                   help="seconds an idle kept-alive connection stays open "
                   "(default %(default)s)")  # fmt: skip
    g = parser.add_argument_group("server")
    g.add_argument("--stats-interval", type=float, default=5.0,
                   help="seconds between stats log lines while busy")  # fmt: skip
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])  # fmt: skip
    g = parser.add_argument_group("replicas (Ray Serve)")
    g.add_argument("--data-parallel-size", type=positive_int, default=1,
                   help="engine replicas behind one ingress on a local Ray instance "
                   "(default 1: no Ray); see server/replicas")  # fmt: skip
    g.add_argument("--router", choices=["prefix", "default"], default="prefix",
                   help="with replicas: prefix-cache-aware (default) or Ray Serve's own")  # fmt: skip


def run_replicas(args: argparse.Namespace) -> int:
    """`--data-parallel-size N`: the Ray Serve application (server/replicas/deployment.py)
    on a local Ray instance, until Ctrl-C."""
    import ray
    from ray import serve

    from server.replicas.deployment import build

    engine = engine_fields_from_args(args)
    server = {"served_model_name": args.served_model_name, "api_key": args.api_key,
              "max_waiting_requests": args.max_waiting_requests,
              "max_request_body_bytes": args.max_request_body_bytes,
              "max_seqs_per_request": args.max_seqs_per_request,
              "queue_timeout": args.queue_timeout,
              "grammar_compile_timeout": args.grammar_compile_timeout}  # fmt: skip
    app = build({"num_replicas": args.data_parallel_size, "router": args.router,
                 "engine": engine, "server": server})  # fmt: skip
    ray.init(include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    print(f"pagedserve: {args.data_parallel_size} replicas ({args.router} routing) on "
          f"http://{args.host}:{args.port}", flush=True)  # fmt: skip
    try:
        serve.run(app, name="pagedserve", route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def pin_prefixes(engine: Any, system_prompts: list[str], prefixes: list[str]) -> Any:
    """Pin each system prompt (rendered as the chat route renders a conversation that opens
    with it) and each raw prefix (encoded as the completions route encodes a prompt);
    ValueError naming the one that cannot be (an unreadable @FILE, no chat template)."""

    def text_of(value: str) -> str:
        if not value.startswith("@"):
            return value
        try:
            return Path(value[1:]).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read the prefix to pin from {value[1:]}: {exc}") from exc

    tokenizer, vocab = engine.tokenizer, engine.vocab_size
    try:
        ids = [
            encode_chat(tokenizer, apply_chat_template(
                tokenizer, [{"role": "system", "content": text_of(p)}], False))
            for p in system_prompts
        ] + [encode_prompt(tokenizer, text_of(p), vocab, "prompt") for p in prefixes]  # fmt: skip
    except OpenAIError as exc:
        raise ValueError(f"cannot pin a prefix: {exc.message}") from exc
    for token_ids in ids:
        pinned = engine.pin_prefix(token_ids)
        logger.info(
            "pinned %d of a %d-token prefix's tokens in the KV cache", pinned, len(token_ids)
        )
    return engine


def run_serve(args: argparse.Namespace) -> int:
    if args.data_parallel_size > 1:
        return run_replicas(args)
    from server.app import build_app
    from server.async_engine import AsyncEngine
    from server.shutdown import GracefulServer

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from engine.core import EngineCore

    def load_on_the_engine_thread(config: Any) -> AsyncEngine:
        # One thread for all torch work: one OpenMP team (server/async_engine.py says why).
        return AsyncEngine.load(
            lambda: pin_prefixes(
                EngineCore.from_config(config), args.pin_system_prompt, args.pin_prefix
            ),
            log_interval_s=args.stats_interval,
        )

    client = _load_engine(args, load_on_the_engine_thread)
    if client is None:
        return 2
    engine = client.core
    app = build_app(
        client,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        max_waiting_requests=args.max_waiting_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        max_seqs_per_request=args.max_seqs_per_request,
        queue_timeout=args.queue_timeout,
        grammar_compile_timeout=args.grammar_compile_timeout,
    )
    print(startup_banner(engine, app.state.ctx.served_model_name, args.host, args.port), flush=True)
    limits = clamp_to_open_files(connection_limits_from_args(args), raise_open_file_limit())
    config = uvicorn_config(
        app, limits, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=5,
    )  # fmt: skip
    GracefulServer(config, client, drain_timeout_s=args.drain_timeout).run()
    code = 0
    if client.died_of_failure:
        print(f"pagedserve: exiting: {client.dead_reason}", file=sys.stderr)
        code = 1
    _exit_without_teardown(code)


def _exit_without_teardown(code: int) -> NoReturn:
    """Exit now that uvicorn and the engine thread have stopped: atexit handlers run and
    output is flushed, but the interpreter's own teardown is skipped. It freed the model,
    the KV cache and torch's native state object by object for ~0.9 s (measured between the
    last atexit handler and the process's end), so the process outlived --drain-timeout by
    a second that a supervisor's kill timer counts too."""
    atexit._run_exitfuncs()  # logging's shutdown among them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def connection_limits_from_args(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(
        max_connections=args.max_connections,
        max_concurrent_requests=args.max_concurrent_requests,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
    )


def startup_banner(core: Any, served_name: str, host: str, port: int) -> str:
    dtype = str(core.dtype).removeprefix("torch.")
    url = f"http://{host}:{port}"
    return (
        f"pagedserve: model {served_name} ({core.model_source}), dtype {dtype}, "
        f"device {core.device}, {core.num_blocks} KV blocks of {core.block_size} "
        f"tokens, max_model_len {core.max_model_len}\n"
        f"pagedserve: {core.compute_summary}\n"
        f"pagedserve: serving the OpenAI API at {url}/v1 (Ctrl-C or SIGTERM drains and stops)"
    )


# ------------------------------------------------------------------------------- generate


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the chat template")  # fmt: skip
    parser.add_argument("--max-tokens", type=positive_int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (the default here) is greedy")  # fmt: skip
    parser.add_argument("--top-p", type=float, default=1.0)
    add_engine_arguments(parser)


def run_generate(args: argparse.Namespace) -> int:
    from engine import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p
        )
    except ValueError as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2
    engine = _load_engine(args)
    if engine is None:
        return 2
    tokenizer = engine.core.tokenizer
    if args.chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    try:
        engine.add_request("generate-0", list(prompt_ids), params)
    except ValueError as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


register(
    Subcommand("serve", "run the OpenAI-compatible HTTP server", add_serve_arguments, run_serve)
)
register(Subcommand("generate", "generate text for one prompt and print it",
                    add_generate_arguments, run_generate))  # fmt: skip


# bench.cli loads only the standard library at import; the load generator, httpx and
# matplotlib load only when `pagedserve bench` runs.
def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.cli import add_arguments

    add_arguments(parser)


def _run_bench(args: argparse.Namespace) -> int:
    from bench.cli import run

    return run(args)


register(Subcommand("bench", "load-test an OpenAI-compatible server (see bench/README.md)",
                    _add_bench_arguments, _run_bench))  # fmt: skip


# ----------------------------------------------------------------------------------- main


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser that adds its arguments when it is first used, not when the
    `pagedserve` parser is built: the engine flags come from `EngineConfig`, whose module
    imports torch, and `pagedserve bench` must not pay for that (nor load it)."""

    def __init__(
        self, *args: Any, add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self._pending_arguments = add_arguments

    def _add_pending_arguments(self) -> None:
        add, self._pending_arguments = self._pending_arguments, None
        if add is not None:
            add(self)

    # argparse's subcommand action parses with parse_known_args; --help and errors format.
    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._add_pending_arguments()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._add_pending_arguments()
        return super().format_usage()

    def format_help(self) -> str:
        self._add_pending_arguments()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="A small OpenAI-compatible LLM server with a prefix-caching paged KV cache.",
    )
    subparsers = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_SubcommandParser
    )
    for sub in SUBCOMMANDS.values():
        subparsers.add_parser(
            sub.name, help=sub.help, description=sub.help, add_arguments=sub.add_arguments
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return SUBCOMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
