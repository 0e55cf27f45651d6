"""docs/reference.md is what server/reference.py generates from the code (flags, routes,
body fields, metrics), so it cannot drift; and the generator sees every flag `serve` takes.
No model is loaded: the app is built over a stand-in engine client."""

from __future__ import annotations

import argparse

from server.cli import add_serve_arguments
from server.reference import COMMAND, REFERENCE, flag_name, render, serve_flags


def test_the_checked_in_reference_is_what_the_code_generates() -> None:
    expected = render()
    found = REFERENCE.read_text(encoding="utf-8") if REFERENCE.exists() else ""
    assert found == expected, (
        f"docs/reference.md is stale (a flag, route, body field or metric changed): "
        f"regenerate it with `{COMMAND}` (or `make reference`) and commit it"
    )


def test_the_reference_lists_every_flag_serve_accepts() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    accepted = {s for action in parser._actions for s in action.option_strings} - {"-h", "--help"}
    listed = {flag_name(field, declared) for _, field, declared in serve_flags()}
    assert listed == accepted


def test_the_reference_covers_the_main_routes_and_metrics() -> None:
    text = render()
    for needle in ("`/v1/chat/completions`", "`/v1/responses`", "`/v1/messages`",
                   "### ChatCompletionRequest", "`pagedserve:time_to_first_token_seconds`",
                   "`pagedserve:kv_cache_blocks`", "`pagedserve:execution_plan_info`"):  # fmt: skip
        assert needle in text, needle
