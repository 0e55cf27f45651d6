"""The server's start-up options (`pagedserve serve`), declared once like the engine's.

Every field is a flag: its `flag()` (engine/config.py) declares the default, kind, choices,
help and --help section, server/config_flags.py builds the flags from them exactly as it
builds EngineConfig's, and a bad value fails here, at start-up, with a ValueError naming
the option. The server reads its options from a `ServerConfig` (server/cli.py's
`run_serve`), never from the parsed flags.

engine/config.py imports torch, so this module does too: server/cli.py imports it only in
the functions that run or describe `serve`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from engine.config import (
    BYTES,
    POSITIVE_INT,
    POSITIVE_SECONDS,
    SECONDS,
    SWITCH,
    Kind,
    declared_problems,
    flag,
)
from server.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_MAX_CONNECTIONS,
    ConnectionLimits,
)
from server.middleware import DEFAULT_MAX_REQUEST_BODY_BYTES
from server.reasoning import REASONING_PARSERS
from server.serving import DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, DEFAULT_MAX_SEQS_PER_REQUEST
from server.shutdown import DEFAULT_DRAIN_TIMEOUT_S
from server.tool_formats import TOOL_PARSERS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
ROUTERS = ("prefix", "default")

# --help's sections past the first ("server"), which every other field is in.
CONNECTIONS = "connections (docs/limits.md)"
SERVER = "server"
REPLICAS = "replicas (Ray Serve)"
MODELS = "several models (docs/models.md)"


def _port(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 65535


def _texts(value: object) -> bool:
    return isinstance(value, tuple) and all(isinstance(text, str) for text in value)


PORT = Kind("int", "a port number from 0 to 65535", _port)
TEXTS = Kind("append", "a tuple of strings", _texts)  # a repeatable flag: a text a use
# The keyword arguments of server/app.py's `build_app` that are options here.
APP_OPTIONS = ("served_model_name", "api_key", "max_waiting_requests", "max_request_body_bytes",
               "max_seqs_per_request", "queue_timeout", "grammar_compile_timeout",
               "reasoning_parser", "tool_call_parser", "return_tokens_as_token_ids")  # fmt: skip


@dataclass(frozen=True)
class ServerConfig:
    host: str = flag("127.0.0.1", help="the address to listen on (default %(default)s)")
    port: int = flag(8000, PORT, help="the port to listen on (default %(default)s)")
    served_model_name: str | None = flag(
        None, help="the model name clients use (default: the model's name)"
    )
    api_key: str | None = flag(
        None,
        env="PAGEDSERVE_API_KEY",
        help="require `Authorization: Bearer KEY` or `x-api-key: KEY` (default "
        "$PAGEDSERVE_API_KEY); /health and /metrics stay open",
    )
    max_waiting_requests: int | None = flag(
        None, POSITIVE_INT, help="answer 503 + Retry-After while this many requests wait"
    )
    max_request_body_bytes: int = flag(
        DEFAULT_MAX_REQUEST_BODY_BYTES,
        BYTES,
        help="answer 413 to a request body larger than this, e.g. 4MiB (default 4 MiB)",
    )
    max_seqs_per_request: int = flag(
        DEFAULT_MAX_SEQS_PER_REQUEST,
        POSITIVE_INT,
        help="answer 400 to a request for more sequences (prompts x n) than this "
        "(default %(default)s)",
    )
    pin_system_prompt: tuple[str, ...] = flag(
        (),
        TEXTS,
        metavar="TEXT",
        help="compute this system prompt (as the chat template renders it first in a "
        "conversation) at start-up and keep its KV blocks resident; @FILE reads it from a "
        "file; repeatable",
    )
    pin_prefix: tuple[str, ...] = flag(
        (), TEXTS, metavar="TEXT", help="the same for a raw completions prompt prefix"
    )
    queue_timeout: float | None = flag(
        None,
        POSITIVE_SECONDS,
        help="seconds a request may wait before its first step; past them it is answered "
        "503 queue_timeout (default: no limit; a request's own `queue_timeout` field wins)",
    )
    grammar_compile_timeout: float = flag(
        DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
        POSITIVE_SECONDS,
        help="seconds an output constraint (JSON schema, grammar, regex, tool calls) may "
        "take to compile, else 400 grammar_compile_timeout, and may wait for the compile "
        "thread, else 503 + Retry-After (default %(default)s)",
    )
    reasoning_parser: str = flag(
        "auto",
        choices=REASONING_PARSERS,
        help="separate a reasoning model's <think> block from its answer (reasoning_content, "
        "reasoning items, thinking blocks): think, none, or auto (think where the chat "
        "template names <think> or </think>; default %(default)s)",
    )
    tool_call_parser: str = flag(
        "auto",
        choices=TOOL_PARSERS,
        help='the tool-call format read under tool_choice "auto" on a template that declares '
        "tools: hermes (<tool_call> blocks), llama3_json, mistral ([TOOL_CALLS]), harmony "
        "(gpt-oss' channels, its reasoning and answer too), or auto (chosen by the "
        "template; default %(default)s). Templates without tools use the generic format "
        "(docs/agents.md)",
    )
    return_tokens_as_token_ids: bool = flag(
        False,
        SWITCH,
        help='write each token of the logprobs as "token_id:<id>", not as its text, as vLLM\'s '
        "flag does (to compare the exact tokens of two answers); a request's own "
        "`return_tokens_as_token_ids` wins (default: texts)",
    )
    drain_timeout: float = flag(
        DEFAULT_DRAIN_TIMEOUT_S,
        SECONDS,
        help="seconds SIGTERM/Ctrl-C lets in-flight requests finish before aborting them "
        "(default %(default)s; a second signal skips it)",
    )
    # The connection limits (server/limits.py's ConnectionLimits).
    max_connections: int = flag(
        DEFAULT_MAX_CONNECTIONS,
        POSITIVE_INT,
        group=CONNECTIONS,
        help="open client connections; past it a new one gets a 503 and is closed "
        "(default %(default)s, lowered to fit the open-file limit)",
    )
    max_concurrent_requests: int = flag(
        DEFAULT_MAX_CONCURRENT_REQUESTS,
        POSITIVE_INT,
        group=CONNECTIONS,
        help="HTTP requests in flight; past it a 503 + Retry-After (default %(default)s)",
    )
    header_timeout: float = flag(
        DEFAULT_HEADER_TIMEOUT_S,
        POSITIVE_SECONDS,
        group=CONNECTIONS,
        help="seconds a connection has to send a request's headers, else it is closed "
        "(slowloris; default %(default)s)",
    )
    body_timeout: float = flag(
        DEFAULT_BODY_TIMEOUT_S,
        POSITIVE_SECONDS,
        group=CONNECTIONS,
        help="seconds after the headers to send the whole body, else the connection is "
        "closed (default %(default)s)",
    )
    keep_alive_timeout: float = flag(
        DEFAULT_KEEP_ALIVE_TIMEOUT_S,
        POSITIVE_SECONDS,
        group=CONNECTIONS,
        help="seconds an idle kept-alive connection stays open (default %(default)s)",
    )
    stats_interval: float = flag(
        5.0, SECONDS, group=SERVER, help="seconds between stats log lines while busy"
    )
    log_level: str = flag("info", choices=LOG_LEVELS, group=SERVER, help="(default info)")
    # --data-parallel-size N > 1: N engine replicas on Ray Serve (server/replicas).
    data_parallel_size: int = flag(
        1,
        POSITIVE_INT,
        group=REPLICAS,
        help="engine replicas behind one ingress on a local Ray instance "
        "(default 1: no Ray); see server/replicas",
    )
    router: str = flag(
        "prefix",
        choices=ROUTERS,
        group=REPLICAS,
        help="with replicas: prefix-cache-aware (default) or Ray Serve's own",
    )
    # Several models in one server (server/model_router.py): a directory of them, or
    # `--model` given more than once (server/model_serving.py checks these against it).
    models_dir: str | None = flag(
        None,
        group=MODELS,
        help="serve every .gguf file and model folder in this directory, each request by "
        "the model its `model` field names, loaded on first use (the first --model, else "
        "the first by name, is the default, loaded at start)",
    )
    max_loaded_models: int | None = flag(
        None,
        POSITIVE_INT,
        group=MODELS,
        help="models loaded at once; past it the least recently used is unloaded once its "
        "requests end (default: no limit)",
    )
    models_memory: int | None = flag(
        None,
        BYTES,
        group=MODELS,
        help="bytes the loaded models may take, weight files + KV pools, e.g. 8GiB; past it "
        "the least recently used is unloaded (default: no limit)",
    )
    pin: tuple[str, ...] = flag(
        (),
        TEXTS,
        metavar="NAME",
        group=MODELS,
        help="load this model at start and never unload it; repeatable",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad option (in field order)."""
        for name, message in _problems(self):
            raise ValueError(f"{name} {message}")

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(
            max_connections=self.max_connections,
            max_concurrent_requests=self.max_concurrent_requests,
            header_timeout_s=self.header_timeout,
            body_timeout_s=self.body_timeout,
            keep_alive_timeout_s=self.keep_alive_timeout,
        )

    def app_options(self) -> dict[str, Any]:
        """server/app.py's `build_app` keyword arguments (the replicas' ingress's too)."""
        return {name: getattr(self, name) for name in APP_OPTIONS}


def _problems(c: ServerConfig) -> list[tuple[str, str]]:
    """(option, message) for every bad value, in field order: the declared kinds' and
    choices', and the texts' (whose kind checks nothing). An empty API key is none."""
    checks: list[tuple[bool, str, str]] = [
        (isinstance(c.host, str) and c.host != "", "host",
         f"must be a host name or address, got {c.host!r}"),
        (c.served_model_name is None or (isinstance(c.served_model_name, str)
                                         and c.served_model_name != ""), "served_model_name",
         f"must be a non-empty string or None, got {c.served_model_name!r}"),
        (c.api_key is None or isinstance(c.api_key, str), "api_key",
         f"must be a string or None, got {c.api_key!r}"),
    ]  # fmt: skip
    found = declared_problems(c) + [(name, message) for ok, name, message in checks if not ok]
    order = {f.name: i for i, f in enumerate(fields(ServerConfig))}
    return sorted(found, key=lambda problem: order[problem[0]])
