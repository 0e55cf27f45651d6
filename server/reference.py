"""docs/reference.md, generated from the code so that it cannot drift: every `pagedserve
serve` flag from the config fields' `flag()` declarations (`EngineConfig`, `ServerConfig`),
every route and request body field from the app's OpenAPI schema (server/reference_api.py),
every metric from the `/metrics` registry (`ServerMetrics`).

    .venv/bin/python -m server.reference          # (re)writes docs/reference.md
    .venv/bin/python -m server.reference --check  # exit 1 when the file is stale

tests/test_docs_reference.py asserts the checked-in file equals `render()`. Nothing here
loads a model: the app is built over a stand-in engine client with the default model's
facts, and the metrics from a fresh registry.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
from collections.abc import Iterator
from dataclasses import MISSING, Field
from pathlib import Path
from typing import Any

from server.reference_api import bodies_section, cell, routes_section

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "reference.md"
COMMAND = ".venv/bin/python -m server.reference"

HEADER = f"""# Reference

Generated from the code by `{COMMAND}` (or `make reference`); do not edit by hand:
`tests/test_docs_reference.py` fails while this file differs from what the command writes.
The task pages ([README](../README.md), [docs/](.)) say when and why to use each of these.

- [`pagedserve serve` flags](#pagedserve-serve-flags)
- [HTTP routes](#http-routes)
- [Request bodies](#request-bodies)
- [Metrics](#metrics)
"""


# -- flags -----------------------------------------------------------------------------


def serve_flags() -> Iterator[tuple[str, Field[Any], Any]]:
    """(--help section, field, Flag) for every `serve` flag, in --help's order: the engine's
    (`EngineConfig`), then the server's (`ServerConfig`), as server/cli.py adds them."""
    from engine.config import EngineConfig, flags_of
    from server.server_config import ServerConfig

    for cls, group in ((EngineConfig, "engine"), (ServerConfig, "server")):
        for field, declared in flags_of(cls):
            yield declared.group or group, field, declared


def flag_name(field: Field[Any], declared: Any) -> str:
    return "--" + (declared.name or field.name.replace("_", "-"))


def default_text(field: Field[Any], declared: Any) -> str:
    """The declared default (never the environment's value, so the file is the same on
    every machine); `$VAR` where a variable sets it."""
    value = None if field.default is MISSING else field.default
    if declared.kind.parse == "switch":
        text = "off"
    elif value is None or value == ():
        text = "none"
    else:
        text = f"`{value}`"
    return f"{text}, or `${declared.env}`" if declared.env else text


# What a kind declared without a noun (`Kind("positive_int")`) takes, by its parser.
_PARSED = {"int": "an integer", "float": "a number", "positive_int": "a positive integer",
           "positive_float": "a number > 0", "size": "a number of bytes", "seconds": "seconds"}  # fmt: skip


def value_text(declared: Any) -> str:
    parse = declared.kind.parse
    if parse == "switch":
        return "(a switch)"
    if parse == "append":
        return "text, repeatable"
    if choices := declared.choice_list():
        return " \\| ".join(f"`{choice}`" for choice in choices)
    return declared.kind.noun or _PARSED.get(parse, "text")


def help_text(field: Field[Any], declared: Any) -> str:
    """The flag's --help text, its default filled in as argparse does."""
    return declared.help % {"default": field.default} if declared.help else ""


def flags_section() -> list[str]:
    rows: dict[str, list[str]] = {}  # --help section -> its rows, sections in first use
    for group, field, declared in serve_flags():
        row = (f"`{flag_name(field, declared)}`", f"`{field.name}`", value_text(declared),
               default_text(field, declared), cell(help_text(field, declared)))  # fmt: skip
        rows.setdefault(group, []).append("| " + " | ".join(row) + " |")
    lines = [
        "## `pagedserve serve` flags",
        "",
        "Each flag is a field of `EngineConfig` (`engine/config.py`; `LLM(**fields)` takes "
        "the same names) or of `ServerConfig` (`server/server_config.py`), declared once "
        "with `flag()`; `pagedserve serve --help` is made from the same declarations. "
        "A bad value is a one-line error at start-up.",
    ]
    for group, section in rows.items():
        lines += ["", f"### {group}", "", "| flag | field | value | default | meaning |",
                  "| --- | --- | --- | --- | --- |", *section]  # fmt: skip
    return lines


# -- metrics ---------------------------------------------------------------------------


def plan_labels() -> list[str]:
    """The labels of `execution_plan_info`: the keys `ExecutionPlan.info()` returns, read
    from its source (a plan needs a model and a machine)."""
    from engine.execution_plan import ExecutionPlan

    source = inspect.cleandoc("\n" + inspect.getsource(ExecutionPlan.info))
    returned = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Return))
    assert isinstance(returned.value, ast.Dict)
    return [key.value for key in returned.value.keys if isinstance(key, ast.Constant)]


def metric_families() -> list[tuple[str, str, list[str], str]]:
    """(name, type, label names, help) of every family a fresh `ServerMetrics` registry
    exports, with the execution plan set and a pool of blocks, in registration order."""
    from kv_cache import BlockCounts
    from server.metrics import ServerMetrics

    metrics = ServerMetrics()
    metrics.set_execution_plan(dict.fromkeys(plan_labels(), ""))
    metrics.watch_kv_blocks(lambda: BlockCounts(free=1, cached=0, in_use=0))
    return _families(metrics.registry) + model_families()


def model_families() -> list[tuple[str, str, list[str], str]]:
    """The families a server of several models adds (server/model_metrics.py), each with
    a sample of a stand-in model so that its labels show."""
    from server.model_metrics import ModelMetrics
    from server.model_registry import ModelEntry

    metrics = ModelMetrics(lambda: [ModelEntry("m", "", 0)])
    metrics.on_loaded("m", 1.0)
    metrics.on_unloaded("m")
    metrics.on_load_failed("m")
    return _families(metrics.registry)


def _families(registry: Any) -> list[tuple[str, str, list[str], str]]:
    found = []
    for family in registry.collect():
        labels: list[str] = []
        for sample in family.samples:
            labels += [name for name in sample.labels if name not in (*labels, "le")]
        name = family.name + ("_total" if family.type == "counter" else "")
        name += "_info" if family.type == "info" else ""
        found.append((name, family.type, labels, family.documentation))
    return found


def metrics_section() -> list[str]:
    lines = [
        "## Metrics",
        "",
        "`GET /metrics`: Prometheus text from `ServerMetrics` (`server/metrics.py`). Behind "
        "`--data-parallel-size` replicas every sample also carries a `replica` label "
        "(`server/replicas/metrics.py`); with several models (docs/models.md) every "
        "engine sample carries a `model` label, and the `model*` families below are added. "
        "Histograms add `_bucket`, `_sum` and `_count`.",
        "",
        "| metric | type | labels | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for name, kind, labels, doc in metric_families():
        shown = ", ".join(f"`{label}`" for label in labels)
        lines.append(f"| `{name}` | {kind} | {shown} | {cell(doc)} |")
    return lines


# -- the file --------------------------------------------------------------------------


def render() -> str:
    """docs/reference.md as the code declares it now."""
    parts = [HEADER.splitlines(), flags_section(), routes_section(), bodies_section(),
             metrics_section()]  # fmt: skip
    return "\n\n".join("\n".join(part).strip("\n") for part in parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.reference", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only say whether it is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        stale = not REFERENCE.exists() or REFERENCE.read_text(encoding="utf-8") != text
        print(f"{REFERENCE.relative_to(REPO)} is {'stale: run ' + COMMAND if stale else 'current'}")
        return 1 if stale else 0
    REFERENCE.write_text(text, encoding="utf-8")
    print(f"wrote {REFERENCE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
