"""The engine's command-line flags: one per `EngineConfig` field, made from the field's
declaration (`flag(...)` in engine/config.py), so a new field is a new flag. A flag left
out keeps that field's default.

engine/config.py imports torch, so this module imports it only inside the functions that
need it: a subcommand that runs no engine (`pagedserve bench`) never loads torch."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from server.arg_types import non_negative_float, parse_size, positive_int

if TYPE_CHECKING:
    from engine.config import Flag


# How the command line reads each kind of engine option (`Kind.parse` in engine/config.py).
_ENGINE_PARSERS: dict[str, Callable[[str], Any]] = {
    "int": int,
    "float": float,
    "positive_int": positive_int,
    "size": parse_size,
    "seconds": non_negative_float,
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The "engine" group: a flag for each `EngineConfig` field, in field order, made from
    the field's declaration. Every flag defaults to None, so a flag left out keeps the
    field's default. Imports engine.config, and so torch: call it only for a subcommand
    that runs the engine (server/cli.py's `_SubcommandParser` defers it until then)."""
    from engine.config import engine_flags

    group = parser.add_argument_group("engine")
    exclusive: dict[str, Any] = {}  # group name -> its mutually exclusive argparse group
    for field, flag in engine_flags():
        target = group
        if flag.exclusive is not None:
            if flag.exclusive not in exclusive:
                exclusive[flag.exclusive] = group.add_mutually_exclusive_group()
            target = exclusive[flag.exclusive]
        name = flag.name or field.name.replace("_", "-")
        target.add_argument(f"--{name}", dest=field.name, help=flag.help,
                            **_value_options(flag, field.default))  # fmt: skip


def _value_options(flag: Flag, default: Any) -> dict[str, Any]:
    """`add_argument`'s options for how an engine flag takes its value."""
    if flag.kind.parse == "switch":  # the flag alone sets the field to the other value
        return {"action": "store_const", "const": not default}
    options: dict[str, Any] = {}
    if flag.kind.parse is not None:
        options["type"] = _ENGINE_PARSERS[flag.kind.parse]
    if choices := flag.choice_list():
        options["choices"] = choices
    return options


def engine_fields_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the user's flags set (the others keep their defaults)."""
    from engine.config import engine_flags

    given = {field.name: getattr(args, field.name) for field, _ in engine_flags()}
    return {name: value for name, value in given.items() if value is not None}


def engine_config_from_args(args: argparse.Namespace) -> Any:
    from engine import EngineConfig

    return EngineConfig(**engine_fields_from_args(args))
