"""The `pagedserve` command: `serve` (the OpenAI-compatible server) and `generate` (one prompt).

Subcommands are entries of `SUBCOMMANDS`; another package adds its own (e.g. `bench`)
with `register(Subcommand(...))` before `main()` builds the parser. The engine's and the
server's flags are the fields of `EngineConfig` (engine/config.py) and `ServerConfig`
(server/server_config.py), made into flags by server/config_flags.py; the value types are
server/arg_types.py's.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from engine.template_bounds import TemplateBoundError
from server.arg_types import positive_int
from server.config_flags import (
    add_config_arguments,
    add_engine_arguments,
    config_from_args,
    engine_config_from_args,
)
from server.errors import OpenAIError
from server.limits import clamp_to_open_files, raise_open_file_limit, uvicorn_config
from server.tokens import apply_chat_template, encode_chat, encode_prompt

if TYPE_CHECKING:  # both import torch, which `pagedserve bench` never loads
    from engine.config import EngineConfig
    from server.server_config import ServerConfig

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


def _error(exc: Exception) -> int:
    print(f"pagedserve: error: {exc}", file=sys.stderr)
    return 2


def _load_engine(config: EngineConfig, build: Callable[[Any], Any] | None = None) -> Any:
    """``build(config)`` (default: the `LLMEngine`), or None after printing why the engine
    could not start (bad option, bad model)."""
    from engine import LLMEngine

    try:
        return (build or LLMEngine)(config)
    except (ValueError, OSError) as exc:
        _error(exc)
        return None


# ---------------------------------------------------------------------------------- serve


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, then the server's: each a field of `EngineConfig` or of
    `ServerConfig` (server/server_config.py), made from its declaration."""
    from server.model_serving import keep_every_model
    from server.server_config import ServerConfig

    add_engine_arguments(parser)
    add_config_arguments(parser, ServerConfig, "server")
    keep_every_model(parser)  # --model given more than once: several models


def serve_from_args(args: argparse.Namespace) -> int:
    """`pagedserve serve`: the configs the flags make (a bad value is a one-line error and
    exit status 2), then `run_serve`."""
    from server.model_serving import several_models
    from server.server_config import ServerConfig

    try:
        engine = engine_config_from_args(args)
        server = config_from_args(ServerConfig, args)
        models = several_models(server, getattr(args, "models", None))
    except ValueError as exc:
        return _error(exc)
    return run_serve(server, engine, models)


def run_replicas(server: ServerConfig, engine: EngineConfig) -> int:
    """`--data-parallel-size N`: the Ray Serve application (server/replicas/deployment.py)
    on a local Ray instance, until Ctrl-C."""
    import ray
    from ray import serve

    from server.replicas.deployment import build

    app = build({"num_replicas": server.data_parallel_size, "router": server.router,
                 "engine": asdict(engine), "server": server.app_options()})  # fmt: skip
    ray.init(include_dashboard=False)
    serve.start(http_options={"host": server.host, "port": server.port})
    print(f"pagedserve: {server.data_parallel_size} replicas ({server.router} routing) on "
          f"http://{server.host}:{server.port}", flush=True)  # fmt: skip
    try:
        serve.run(app, name="pagedserve", route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def pin_prefixes(engine: Any, system_prompts: Sequence[str], prefixes: Sequence[str]) -> Any:
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
    limits = engine.chat_template_limits  # the bounds the template was checked under
    try:
        ids = [
            encode_chat(tokenizer, apply_chat_template(
                tokenizer, [{"role": "system", "content": text_of(p)}], False, limits=limits))
            for p in system_prompts
        ] + [encode_prompt(tokenizer, text_of(p), vocab, "prompt") for p in prefixes]  # fmt: skip
    except (OpenAIError, TemplateBoundError) as exc:
        raise ValueError(f"cannot pin a prefix: {getattr(exc, 'message', exc)}") from exc
    for token_ids in ids:
        pinned = engine.pin_prefix(token_ids)
        logger.info(
            "pinned %d of a %d-token prefix's tokens in the KV cache", pinned, len(token_ids)
        )
    return engine


def run_serve(
    server: ServerConfig, engine_config: EngineConfig, models: tuple[str, ...] | None = None
) -> int:
    """The server `server` describes over the engine `engine_config` describes, until
    SIGTERM or Ctrl-C (then the process exits here); 2 if the engine cannot start.
    `models`: serve several models (server/model_serving.py's `several_models`)."""
    if server.data_parallel_size > 1:
        return run_replicas(server, engine_config)
    from server.app import build_app
    from server.async_engine import AsyncEngine
    from server.shutdown import GracefulServer

    logging.basicConfig(
        level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from engine.core import EngineCore

    def load_on_the_engine_thread(config: Any, tokenizer: Any = None) -> AsyncEngine:
        # One thread for all torch work: one OpenMP team (server/async_engine.py says why).
        return AsyncEngine.load(
            lambda: pin_prefixes(
                EngineCore.from_config(config, tokenizer=tokenizer),
                server.pin_system_prompt,
                server.pin_prefix,
            ),
            log_interval_s=server.stats_interval,
        )

    if models is not None:
        from server.model_serving import models_banner, start_models

        try:  # the default and pinned models load now; the others when asked for
            client, router = start_models(server, engine_config, models, load_on_the_engine_thread)
        except ValueError as exc:
            return _error(exc)
        app = build_app(client, models=router, **server.app_options(),
                        chat_template_timeout=engine_config.chat_template_timeout)  # fmt: skip
        print(models_banner(router, server.host, server.port), flush=True)
    else:
        client = _load_engine(engine_config, load_on_the_engine_thread)
        if client is None:
            return 2
        app = build_app(client, **server.app_options(),
                        chat_template_timeout=engine_config.chat_template_timeout)  # fmt: skip
        served_name = app.state.ctx.served_model_name
        print(startup_banner(client.core, served_name, server.host, server.port), flush=True)
    limits = clamp_to_open_files(server.connection_limits(), raise_open_file_limit())
    config = uvicorn_config(
        app, limits, host=server.host, port=server.port, log_level=server.log_level,
        timeout_graceful_shutdown=5,
    )  # fmt: skip
    GracefulServer(config, client, drain_timeout_s=server.drain_timeout).run()
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
        return _error(exc)
    try:
        engine_config = engine_config_from_args(args)
    except ValueError as exc:
        return _error(exc)
    engine = _load_engine(engine_config)
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
        return _error(exc)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


register(
    Subcommand(
        "serve", "run the OpenAI-compatible HTTP server", add_serve_arguments, serve_from_args
    )
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
