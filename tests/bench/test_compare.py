"""`pagedserve bench compare` end to end on a tiny model, and its server plumbing."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench import compare
from bench.cli import main

REPO = Path(__file__).resolve().parents[2]
PAGEDSERVE_ARGS = "--dtype float32 --num-blocks 256 --max-num-batched-tokens 512"


def test_compare_runs_two_servers_and_writes_the_table(tiny_model_dir: Path, tmp_path: Path):
    out = tmp_path / "results"
    code = main([
        "compare", "--servers", "pagedserve,naive", "--model", str(tiny_model_dir),
        "--workload", "shared-prefix", "--num-requests", "4", "--num-prefixes", "2",
        "--prefix-len", "32", "--max-tokens", "3", "--concurrency", "1,2",
        "--pagedserve-args", PAGEDSERVE_ARGS, "--out", str(out), "--no-plots", "--no-progress",
        "--startup-timeout", "300",
    ])  # fmt: skip
    assert code == 0
    records = json.loads((out / "results.json").read_text())
    assert [(r["server"], r["concurrency"]) for r in records] == [
        ("pagedserve", 1), ("pagedserve", 2), ("naive", 1), ("naive", 2)
    ]  # fmt: skip
    for r in records:
        assert (r["requests"], r["errors"], r["output_tokens"]) == (4, 0, 12), r
    # only pagedserve has /metrics; its second request of a group hits the prefix cache
    assert records[0]["server_metrics"]["prefix_cache_hit_rate"] > 0
    assert records[2]["server_metrics"] is None
    table = (out / "results.md").read_text()
    assert re.search(r"^\| pagedserve \| shared-prefix \| 2 \| 4/0 \|", table, re.M)
    assert re.search(r"^\| naive \| shared-prefix \| 1 \| 4/0 \|", table, re.M)
    assert "vs naive: output tok/s" in table and "load average" in table
    # every server was stopped: the ports in the logged commands no longer answer
    for name in ("pagedserve", "naive"):
        log = (out / "logs" / f"{name}.log").read_text()
        port = re.search(r"--port (\d+)", log).group(1)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)


def parse_compare(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare_args = parser.add_subparsers(dest="bench_command").add_parser("compare")
    from bench.cli import add_compare_arguments

    add_compare_arguments(compare_args)
    return parser.parse_args(["compare", *argv])


def test_server_commands(monkeypatch, capsys):
    args = parse_compare("--model", "m.gguf", "--max-tokens", "7", "--pagedserve-args", "--seed 3")
    specs = {s.name: s for s in compare.server_specs(args)}
    on, off = specs["pagedserve"].command(1234), specs["pagedserve-no-cache"].command(1234)
    assert "--no-prefix-caching" not in on and "--no-prefix-caching" in off
    assert on[-2:] == ["--seed", "3"] and on[on.index("--port") + 1] == "1234"
    assert specs["naive"].command(5)[1:3] == ["-m", "bench.naive_server"]
    assert args.concurrency == [1, 8, 32] and args.workload == ["shared-prefix", "unique"]
    if "llama.cpp" in specs:  # llama-cpp-python installed: same GGUF, no interrupts
        argv = specs["llama.cpp"].command(99)
        assert argv[argv.index("--model") + 1] == "m.gguf"
        assert argv[argv.index("--interrupt_requests") + 1] == "False"
        assert specs["llama.cpp"].extra_body == {"min_tokens": 7}  # its ignore_eos

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llama_cpp" else real_find_spec(n)
    )
    names = [s.name for s in compare.server_specs(parse_compare("--servers", "naive,llama.cpp"))]
    assert names == ["naive"]
    assert "llama.cpp skipped: llama-cpp-python is not installed" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="unknown server"):
        compare.server_specs(parse_compare("--servers", "vllm"))


def test_a_server_that_dies_at_start_is_reported_not_raised(tmp_path: Path, capsys):
    crash = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    spec = compare.ServerSpec("crashy", lambda port: crash)
    args = parse_compare("--startup-timeout", "60")
    assert compare.measure_server(spec, args, tokenizer=None, out=tmp_path) == []
    err = capsys.readouterr().err
    assert "crashy failed to start: exited with code 3" in err and "no model here" in err


def test_bench_subcommand_is_registered_without_importing_the_load_generator():
    check = (
        "import sys\n"
        "from server.cli import build_parser\n"
        "a = build_parser().parse_args(['bench', '--concurrency', '1,8,inf'])\n"
        "assert a.concurrency == [1, 8, None] and a.bench_command is None\n"
        "heavy = ('bench.loadgen', 'bench.compare', 'httpx', 'torch', 'matplotlib')\n"
        "print(','.join(m for m in heavy if m in sys.modules) or 'clean')\n"
    )
    done = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "clean"
