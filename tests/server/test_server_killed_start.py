"""A first start SIGKILLed while it writes its cache (issue 29, faults): the next start
finds nothing torn to trust and serves what a clean start serves.

On a GGUF's first start the server writes the file's config and tokenizer into
$PAGEDSERVE_CACHE (engine/loader.py: a temporary directory, renamed into place). The
kernels' build is the other file the server writes for itself; its kill is tested in
tests/engine/test_kernel_build.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from engine.loader import convert_gguf, default_gguf_path, load_tokenizer
from tests.server.test_server_cli import ENGINE_FLAGS, REPO, free_port, greedy_engine_text
from tests.server.test_server_shutdown import serve_process

PROMPT = "The capital of France is"


def _killed_while_converting(cache: Path) -> Path:
    """Starts the server on the default model with an empty cache and SIGKILLs it while its
    temporary conversion directory exists; returns that directory."""
    script = "import sys; from server.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = [sys.executable, "-c", script, "serve", "--port", str(free_port()), *ENGINE_FLAGS]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PAGEDSERVE_CACHE": str(cache)}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if tmp := next(cache.glob("*/.tmp-*"), None):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return tmp
            time.sleep(0.005)
        raise AssertionError(f"no conversion directory appeared (exit code {proc.poll()})")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_start_killed_mid_conversion_then_serves_as_a_clean_start(tmp_path):
    cache = tmp_path / "cache"
    torn = _killed_while_converting(cache)
    assert torn.is_dir(), "the kill came after the conversion was renamed into place"
    assert [p.name for p in torn.parent.iterdir()] == [torn.name], "a cache besides the torn one"

    with serve_process(ENGINE_FLAGS, env={"PAGEDSERVE_CACHE": str(cache)}) as (_, url):
        body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert not torn.exists(), "the dead start's temporary directory was left"
    [converted] = torn.parent.iterdir()
    assert (converted / "pagedserve_source.json").is_file()

    prompt_ids = load_tokenizer(convert_gguf(default_gguf_path())).encode(PROMPT)
    assert answer["usage"]["prompt_tokens"] == len(prompt_ids)
    assert answer["choices"][0]["text"] == greedy_engine_text(None, prompt_ids, 12)
