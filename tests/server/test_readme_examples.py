"""The README's examples run: every ```python block and every curl command in README.md,
against a live server (the tiny random model served under the README's model name, at
the README's address replaced by the test server's). Their printed text is the tiny
model's, so only that they run without an error is checked, not what they print."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import RunningServer, make_engine, running_server

README = Path(__file__).resolve().parents[2] / "README.md"
ADDRESS = "http://127.0.0.1:8000"
MODEL = "SmolLM2-135M-Instruct"


def blocks(language: str) -> list[str]:
    text = README.read_text(encoding="utf-8")
    return [b for lang, b in re.findall(r"```(\w*)\n(.*?)```", text, re.S) if lang == language]


def curl_commands() -> list[str]:
    """The ```bash blocks that call the server with curl, each a script of its own."""
    return [block for block in blocks("bash") if block.lstrip().startswith("curl ")]


@pytest.fixture(scope="module")
def readme_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with running_server(make_engine(tiny_model_dir), served_model_name=MODEL) as s:
        yield s


def test_the_readme_has_examples_for_each_api() -> None:
    commands = " ".join(curl_commands())
    for route in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        assert route in commands, route
    assert len(blocks("python")) >= 3


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_a_readme_python_example_runs(readme_server: RunningServer, index: int) -> None:
    code = blocks("python")[index].replace(ADDRESS, readme_server.url)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, f"README.md python block {index}", "exec"), {})
    assert printed.getvalue()


@pytest.mark.parametrize("index", range(len(curl_commands())))
def test_a_readme_curl_example_runs(readme_server: RunningServer, index: int) -> None:
    command = curl_commands()[index].replace(ADDRESS, readme_server.url)
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body.get("error") is None and body.get("type") != "error", body
