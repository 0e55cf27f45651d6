"""`pagedserve generate` in-process, and `python -m server` as a real process stopped by Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from engine import SamplingParams
from server.cli import main
from tests.server.conftest import make_engine, random_ids, sse_payloads, wait_until

REPO = Path(__file__).resolve().parents[2]
ENGINE_FLAGS = ["--dtype", "float32", "--device", "cpu", "--num-blocks", "64"]


def greedy_engine_text(model_dir, prompt_ids, max_tokens) -> str:
    engine = make_engine(model_dir, num_blocks=64)
    engine.add_request("ref", prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    text = ""
    while engine.has_unfinished_requests():
        text += "".join(o.new_text for o in engine.step())
    return text


def test_generate_prints_the_greedy_text(tiny_model_dir, capsys):
    code = main(["generate", "Hello there", "--model", str(tiny_model_dir), "--max-tokens", "6",
                 *ENGINE_FLAGS])  # fmt: skip
    assert code == 0
    engine = make_engine(tiny_model_dir, num_blocks=64)
    expected = greedy_engine_text(tiny_model_dir, engine.core.tokenizer.encode("Hello there"), 6)
    assert capsys.readouterr().out == expected + "\n"


def test_generate_chat_uses_the_chat_template(tiny_model_dir, capsys):
    code = main(["generate", "Hi", "--chat", "--model", str(tiny_model_dir), "--max-tokens", "4",
                 *ENGINE_FLAGS])  # fmt: skip
    assert code == 0
    tokenizer = make_engine(tiny_model_dir, num_blocks=64).core.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert capsys.readouterr().out == greedy_engine_text(tiny_model_dir, ids, 4) + "\n"


def test_generate_reports_bad_options_without_a_traceback(tiny_model_dir, capsys):
    code = main(["generate", "x", "--model", str(tiny_model_dir), "--temperature", "-1"])
    assert code == 2 and "temperature" in capsys.readouterr().err
    code = main(["generate", "x", "--model", str(tiny_model_dir / "missing"), *ENGINE_FLAGS])
    assert code == 2 and "error" in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_process_starts_serves_and_stops_cleanly_on_ctrl_c(tiny_model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "--model", str(tiny_model_dir), "--port", str(port),
         "--served-model-name", "tiny", "--log-level", "warning", "--drain-timeout", "0",
         *ENGINE_FLAGS],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: _healthy(url) or proc.poll() is not None, 180, "server did not start")
        assert proc.poll() is None, proc.stdout.read()
        body = {"model": "tiny", "prompt": random_ids(801, 10), "max_tokens": 900,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGINT)  # Ctrl-C with a stream in flight, no drain
            rest = sse_payloads(lines)
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["error"]["code"] == "server_shutdown"
        assert proc.wait(timeout=60) == 0
        output = proc.stdout.read()
        assert "64 KV blocks" in output and f"{url}/v1" in output and "float32" in output
        assert "Traceback" not in output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
