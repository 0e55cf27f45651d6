"""bench.gpu_pack: what a bare GPU host is brought, and the run script that uses it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from bench.gpu_pack import HOST_HAS, ROOTS, closure

REPO = Path(__file__).resolve().parents[2]


def test_the_closure_pins_what_the_host_lacks_and_skips_what_it_has():
    pins = dict(pin.split("==") for pin in closure(ROOTS))
    # The server's own stack, and what it needs that the image does not hold.
    assert {"fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "xgrammar"} <= set(pins)
    assert not set(pins) & HOST_HAS  # torch, transformers, httpx, ... stay the host's
    # The image's own may be older than pydantic and starlette need (they shadow it).
    assert {"typing-extensions", "anyio"} <= set(pins)
    assert all(version[0].isdigit() for version in pins.values())


def test_the_run_script_parses():
    subprocess.run(["sh", "-n", str(REPO / "bench" / "gpu_run.sh")], check=True)
