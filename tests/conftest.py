"""Suite-wide set-up: an offline, repo-local model cache shared by every test run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The default model's GGUF is converted once into this cache; a fresh clone pays
# the conversion in its first run only.
os.environ.setdefault("PAGEDSERVE_CACHE", str(Path(__file__).resolve().parent.parent / ".cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Before any test imports torch: see engine/__init__.py.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# pytest-xdist runs the suite in several processes: each gets its share of the cores for
# torch's threads, as tensor-parallel ranks do (engine/tp_worker.py), and the servers the
# tests start inherit it. With two threads in each of two workers on 2 cores, a step's
# parallel regions waited for a sibling thread the OS had not scheduled: beside two busy
# processes a 2 s test of the default model took 60-80 s (about 1 token/s). Two threads
# giving the same tokens as one is a test of its own (tests/engine/test_threads.py).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        help="where the device-agnostic tests (marked `device`) run: cpu (default; Triton "
        "kernels through Triton's interpreter) or cuda, e.g. `pytest --device cuda -m device`",
    )


def pytest_configure(config) -> None:
    # On CPU the Triton kernels run through Triton's interpreter; it is read when a kernel
    # is defined, so before any test module imports one.
    if config.getoption("--device") == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device(request):
    """The device of the device-agnostic tests (`--device`): a torch.device."""
    import torch  # not at the top: the environment above must be set before torch loads

    device = torch.device(request.config.getoption("--device"))
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.fail("--device cuda, but torch sees no CUDA device")
    return device


def pytest_sessionstart(session) -> None:
    """Convert the embedded default model before any test starts a server with a deadline.

    A fresh clone has an empty cache; the conversion (30-90 s on a busy 2-core machine)
    would otherwise happen inside whichever test first needs the tokenizer. A host that
    brings only the tokenizer (PAGEDSERVE_TEST_TOKENIZER: a GPU host, bench/gpu_run.sh) runs
    only tests of tiny models and converts nothing.
    """
    if os.environ.get("PAGEDSERVE_TEST_TOKENIZER"):
        return
    from engine.loader import resolve_model_dir

    resolve_model_dir(None)


def pytest_terminal_summary(terminalreporter) -> None:
    """One line naming the tests this CPU could not check: on an AVX2-only machine the
    AVX512-BF16 kernels' tests skip, and what skips here is checked only where a session
    lands on the other kind (whose `make test` runs this machine's path too)."""
    counts: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        if "AVX512" in reason:
            file = Path(report.location[0]).name
            counts[file] = counts.get(file, 0) + 1
    if counts:
        files = ", ".join(f"{file} ({n})" for file, n in sorted(counts.items()))
        terminalreporter.write_line(
            f"Not checked on this CPU (no AVX512-BF16): {sum(counts.values())} tests in {files}"
        )
