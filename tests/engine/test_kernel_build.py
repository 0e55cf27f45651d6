"""The kernels' build survives being killed: a build SIGKILLed half-way, or a library torn
on disk, never blocks or breaks the next start (issue 29, faults).

A tiny extension stands in for the real kernels (through pybind11 where a build must last
long enough to be killed, else through Python's C API alone); it goes through the same
`_build` as they do, in a TORCH_EXTENSIONS_DIR of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine import kernels

# pybind11 takes seconds to compile: long enough to kill a build half-way.
SLOW_SOURCE = textwrap.dedent("""
    #include <pybind11/pybind11.h>
    int answer() { return 42; }
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
""")
# The same module through Python's C API alone: built in about a second.
FAST_SOURCE = textwrap.dedent("""
    #include <Python.h>
    #define NAME_(x) #x
    #define NAME(x) NAME_(x)
    #define INIT_(x) PyInit_##x
    #define INIT(x) INIT_(x)
    static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
    static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr},
                                    {nullptr, nullptr, 0, nullptr}};
    static PyModuleDef module = {PyModuleDef_HEAD_INIT, NAME(TORCH_EXTENSION_NAME), nullptr, -1,
                                 methods};
    PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
""")
# Run in a child: builds the tiny extension and prints what it answers.
BUILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from engine.kernels import _build
    module = _build("pagedserve_tiny", [Path(sys.argv[1])], ["-O0"])
    print("answer", module.answer() if module is not None else None, flush=True)
""")
REPO = Path(__file__).resolve().parents[2]


def _child(source: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", BUILD, str(source)], cwd=REPO, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def _answer(source: Path, env: dict[str, str], timeout_s: float = 240) -> str:
    child = _child(source, env)
    try:
        out, _ = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        pytest.fail(f"the build did not finish in {timeout_s:.0f} s: it waits on a stale lock")
    assert child.returncode == 0, out
    return out.strip().splitlines()[-1]


def _tiny(tmp_path: Path, text: str) -> tuple[Path, dict[str, str]]:
    source = tmp_path / "tiny.cpp"
    source.write_text(text)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    return source, env


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    return _tiny(tmp_path, FAST_SOURCE)


@pytest.fixture
def slow_tiny(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    return _tiny(tmp_path, SLOW_SOURCE)


def test_a_build_killed_half_way_does_not_block_the_next(slow_tiny):
    source, env = slow_tiny
    child = _child(source, env)
    deadline = time.monotonic() + 120
    build = None
    while time.monotonic() < deadline and child.poll() is None:
        found = list((Path(env["TORCH_EXTENSIONS_DIR"])).glob("pagedserve_tiny_*/lock"))
        if found:
            build = found[0].parent
            break
        time.sleep(0.01)
    assert build is not None, "the child never took torch's build lock"
    time.sleep(0.5)  # into the compile
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    assert (build / "lock").exists(), "the kill came too late to leave torch's lock behind"
    assert _answer(source, env) == "answer 42"


def test_a_torn_library_is_built_again(tiny):
    source, env = tiny
    assert _answer(source, env) == "answer 42"
    [library] = Path(env["TORCH_EXTENSIONS_DIR"]).glob("pagedserve_tiny_*/*.so")
    library.write_bytes(library.read_bytes()[:4096])  # cut short, and newer than its source
    assert _answer(source, env) == "answer 42"


def test_the_build_dir_follows_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert kernels.build_dir("x") == tmp_path / "x"


@pytest.mark.parametrize("value", ["off", "0"])
def test_switched_off_nothing_is_built_and_torch_serves(tiny, value):
    source, env = tiny
    assert _answer(source, {**env, kernels.SWITCH: value}) == "answer None"
    assert not Path(env["TORCH_EXTENSIONS_DIR"]).exists()
