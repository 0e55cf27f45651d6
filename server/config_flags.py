"""Command-line flags made from a config dataclass's declarations: one flag per field
declared with `flag(...)` (engine/config.py), so a new field is a new flag. `EngineConfig`'s
fields are the engine's flags (`serve`, `generate`), `ServerConfig`'s
(server/server_config.py) the server's (`serve`); `config_from_args` builds the dataclass
back from the parsed flags, and the dataclass validates the values.

A flag's default is its field's (or its `env` variable's value, read when the parser is
built), so the parsed namespace holds every field. engine/config.py imports torch, so this
module imports it only inside the functions that need it: a subcommand that runs no engine
(`pagedserve bench`) never loads torch."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import Field
from typing import TYPE_CHECKING, Any

from server.arg_types import non_negative_float, parse_size, positive_float, positive_int

if TYPE_CHECKING:
    from engine.config import EngineConfig, Flag


# How the command line reads each kind of value (`Kind.parse` in engine/config.py); two
# more, "switch" and "append", are actions (`_value_options`).
_PARSERS: dict[str, Callable[[str], Any]] = {
    "int": int,
    "float": float,
    "positive_int": positive_int,
    "positive_float": positive_float,
    "size": parse_size,
    "seconds": non_negative_float,
}


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, group: str) -> None:
    """A flag for each field of the dataclass `cls` declared with `flag()`, in field order,
    made from the declaration, in the --help section its Flag names (`group` where it names
    none); consecutive fields of one section share it."""
    from engine.config import flags_of

    section: Any = None
    title = None
    exclusive: dict[str, Any] = {}  # group name -> its mutually exclusive argparse group
    for field, flag in flags_of(cls):
        if (flag.group or group) != title:
            title = flag.group or group
            section = parser.add_argument_group(title)
        target = section
        if flag.exclusive is not None:
            if flag.exclusive not in exclusive:
                exclusive[flag.exclusive] = section.add_mutually_exclusive_group()
            target = exclusive[flag.exclusive]
        name = flag.name or field.name.replace("_", "-")
        target.add_argument(f"--{name}", dest=field.name, help=flag.help,
                            **_value_options(flag, field))  # fmt: skip


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The "engine" section: a flag for each `EngineConfig` field. Imports engine.config,
    and so torch: call it only for a subcommand that runs the engine (server/cli.py's
    `_SubcommandParser` defers it until then)."""
    from engine.config import EngineConfig

    add_config_arguments(parser, EngineConfig, "engine")


def _value_options(flag: Flag, field: Field[Any]) -> dict[str, Any]:
    """`add_argument`'s options for how a flag takes its value and what it defaults to."""
    default = field.default
    if flag.env is not None:
        default = os.environ.get(flag.env, default)
    options: dict[str, Any] = {"default": default}
    if flag.metavar is not None:
        options["metavar"] = flag.metavar
    if flag.kind.parse == "switch":  # the flag alone sets the field to the other value
        return {**options, "action": "store_const", "const": not default}
    if flag.kind.parse == "append":  # repeatable: each use adds a value (to a list)
        return {**options, "action": "append", "default": None}
    if flag.kind.parse is not None:
        options["type"] = _PARSERS[flag.kind.parse]
    if choices := flag.choice_list():
        options["choices"] = choices
    return options


def fields_from_args(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of `cls` that have a flag, as the parsed flags set them (a repeatable
    flag's values as a tuple; one never given keeps the field's default)."""
    from engine.config import flags_of

    found = {}
    for field, flag in flags_of(cls):
        value = getattr(args, field.name)
        if flag.kind.parse == "append":
            value = field.default if value is None else tuple(value)
        found[field.name] = value
    return found


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    """`cls` made from the parsed flags; ValueError naming a bad value."""
    return cls(**fields_from_args(cls, args))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from engine.config import EngineConfig

    return config_from_args(EngineConfig, args)
