"""`pagedserve generate` in-process, `python -m server` as a real process stopped by Ctrl-C,
and the serve flags made from ServerConfig's fields."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import httpx
import pytest

from engine import EngineConfig, SamplingParams
from engine.config import flags_of
from server.cli import build_parser, main
from server.config_flags import config_from_args
from server.server_config import CONNECTIONS, MODELS, REPLICAS, SERVER, ServerConfig
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


# -- the serve flags: ServerConfig's fields (server/server_config.py) ---------------------


def _serve_help(capsys) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    return capsys.readouterr().out


def test_every_server_config_field_is_a_serve_flag_listed_with_its_help(capsys, monkeypatch):
    """The flags are generated from the declarations: each field has one, --help lists it
    with its help text (its default filled in) in its section, and no flag parsed is left
    without a field."""
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping (which breaks "open-file" in two)
    help_text = _serve_help(capsys)
    words = " ".join(help_text.split())
    sections = [line[:-1] for line in help_text.splitlines() if line.endswith(":")]
    declared = {field.name: (field, flag) for field, flag in flags_of(ServerConfig)}
    assert [f.name for f in fields(ServerConfig)] == list(declared)  # every field has a flag
    for field, flag in declared.values():
        name = "--" + (flag.name or field.name.replace("_", "-"))
        assert f" {name} " in words, name
        if flag.help:
            assert " ".join((flag.help % {"default": field.default}).split()) in words, name
    assert sections == ["options", "engine", "server", CONNECTIONS, SERVER, REPLICAS, MODELS]
    args = build_parser().parse_args(["serve"])
    assert config_from_args(ServerConfig, args) == ServerConfig()
    engine_dests = {f.name for f in fields(EngineConfig)}
    assert set(vars(args)) == {"command"} | engine_dests | set(declared)


def test_the_serve_flags_make_the_server_config(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    args = build_parser().parse_args(
        ["serve", "--host", "0.0.0.0", "--port", "9001", "--api-key", "k", "--pin-prefix", "a",
         "--pin-prefix", "@b.txt", "--max-request-body-bytes", "1MiB", "--queue-timeout", "2",
         "--drain-timeout", "0", "--log-level", "debug", "--data-parallel-size", "2",
         "--router", "default", "--stats-interval", "0.5", "--return-tokens-as-token-ids"]
    )  # fmt: skip
    config = config_from_args(ServerConfig, args)
    assert (config.host, config.port, config.api_key) == ("0.0.0.0", 9001, "k")
    assert config.pin_prefix == ("a", "@b.txt") and config.pin_system_prompt == ()
    assert config.max_request_body_bytes == 1 << 20 and config.queue_timeout == 2.0
    assert (config.drain_timeout, config.log_level, config.stats_interval) == (0.0, "debug", 0.5)
    assert (config.data_parallel_size, config.router) == (2, "default")
    assert config.app_options()["api_key"] == "k"
    assert config.app_options()["return_tokens_as_token_ids"] is True
    assert hash(config)  # frozen, of tuples: usable as a key


@pytest.mark.parametrize(
    ("fields_", "option"),
    [
        ({"port": 70000}, "port"),
        ({"host": ""}, "host"),
        ({"served_model_name": ""}, "served_model_name"),
        ({"max_waiting_requests": 0}, "max_waiting_requests"),
        ({"pin_prefix": ["a list"]}, "pin_prefix"),
        ({"queue_timeout": 0}, "queue_timeout"),
        ({"grammar_compile_timeout": float("inf")}, "grammar_compile_timeout"),
        ({"drain_timeout": -1}, "drain_timeout"),
        ({"stats_interval": float("nan")}, "stats_interval"),
        ({"log_level": "loud"}, "log_level"),
        ({"router": "random"}, "router"),
        ({"max_connections": True}, "max_connections"),
    ],
)
def test_a_bad_server_option_is_a_value_error_naming_it(fields_, option):
    with pytest.raises(ValueError, match=rf"^{option} must be"):
        ServerConfig(**fields_)


def test_serve_refuses_a_bad_option_before_loading_the_engine(capsys):
    # No model is loaded (none is named, and the default's load would take seconds).
    assert main(["serve", "--port", "70000"]) == 2
    assert capsys.readouterr().err.strip() == (
        "pagedserve: error: port must be a port number from 0 to 65535, got 70000"
    )
