"""The model-alternate and model-zipf workloads (issue 44): each request goes to one of
several models of one server, named by /v1/models (or --models). No server runs: a canned
one answers."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx

from bench import loadgen
from bench.arguments import add_arguments, load_config_from_args, workload_spec
from bench.loadgen import LoadConfig, run_load
from bench.workloads import WorkloadSpec, build_prompts


class Words:
    """A tokenizer of one token per word: enough to build prompts of given lengths."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [hash(w) % 1000 for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join("w" for _ in ids)


def test_model_alternate_takes_turns_and_model_zipf_favours_the_first() -> None:
    spec = WorkloadSpec("model-alternate", num_requests=6, prefix_len=8, num_models=3)
    assert [p.model_index for p in build_prompts(spec, Words())] == [0, 1, 2, 0, 1, 2]
    zipf = WorkloadSpec("model-zipf", num_requests=300, prefix_len=8, num_models=3)
    counts = Counter(p.model_index for p in build_prompts(zipf, Words()))
    assert counts[0] > counts[1] > counts[2] > 0  # weights 1, 1/2, 1/3
    assert build_prompts(zipf, Words()) == build_prompts(zipf, Words())  # seeded
    assert build_prompts(WorkloadSpec("unique", 2, 8), Words())[0].model_index is None


def canned_run(cfg: LoadConfig, spec: WorkloadSpec) -> tuple[list[str | None], loadgen.LoadRun]:
    sent: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "a"}, {"id": "b"}, {"id": "c"}]})  # fmt: skip
        sent.append(json.loads(request.content).get("model"))
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}],
                                         "usage": {"completion_tokens": 1}})  # fmt: skip

    real = loadgen.make_client

    def mocked(cfg: LoadConfig, connections: int) -> httpx.AsyncClient:
        client = real(cfg, connections)
        client._transport = httpx.MockTransport(handler)
        return client

    loadgen.make_client = mocked
    try:
        run = asyncio.run(run_load(cfg, build_prompts(spec, Words())))
    finally:
        loadgen.make_client = real
    return sent, run


def test_requests_go_to_the_models_the_server_lists_in_turn() -> None:
    cfg = LoadConfig(base_url="http://test", stream=False, concurrency=1, progress=False)
    spec = WorkloadSpec("model-alternate", num_requests=4, prefix_len=8, num_models=2)
    sent, run = canned_run(cfg, spec)
    assert sent == ["a", "b", "a", "b"]
    assert [r.model for r in run.results] == ["a", "b", "a", "b"] and run.model == "a,b,c"
    named = LoadConfig(base_url="http://test", stream=False, concurrency=1, progress=False,
                       models=("c", "a"))  # fmt: skip
    assert canned_run(named, spec)[0] == ["c", "a", "c", "a"]
    plain, _ = canned_run(cfg, WorkloadSpec("unique", num_requests=2, prefix_len=8))
    assert plain == ["a", "a"]  # one model: the first listed, as before


def test_the_flags() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--workload", "model-zipf", "--models", "x,y,z", "--num-models",
                              "3"])  # fmt: skip
    assert load_config_from_args(args, "http://h", None).models == ("x", "y", "z")
    assert workload_spec(args, "model-zipf").num_models == 3


def test_the_swap_in_bench_serves_a_directory_of_links_with_room_for_one(tmp_path) -> None:
    from bench.swap_in import link_models, llama_server_argv, pagedserve_argv

    files = [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    for f in files:
        f.write_bytes(b"GGUF")
    folder = link_models(files, tmp_path / "models")
    assert sorted(p.name for p in folder.iterdir()) == ["a.gguf", "b.gguf"]
    assert (folder / "a.gguf").resolve() == files[0].resolve()
    ours = pagedserve_argv(folder, 9, 4096, ["--dtype", "float32"])
    assert ours[ours.index("--max-loaded-models") + 1] == "1"
    assert ours[-2:] == ["--dtype", "float32"]
    assert ours[ours.index("--num-blocks") + 1] == "256"  # the same KV budget: 4096 tokens
    peer = llama_server_argv(tmp_path / "llama-server", folder, 9, 4096, [])
    assert peer[peer.index("--models-max") + 1] == "1" and peer[peer.index("-c") + 1] == "4096"


def test_the_traffic_bench_gives_both_servers_room_for_two_and_the_same_slots(tmp_path) -> None:
    from bench.model_traffic import RUNS, llama_server_argv, pagedserve_argv

    ours = pagedserve_argv(tmp_path, 9, 2, 8192, 8, [])
    peer = llama_server_argv(tmp_path / "llama-server", tmp_path, 9, 2, 8192, 8, [])
    assert (
        ours[ours.index("--max-loaded-models") + 1] == "2" == peer[peer.index("--models-max") + 1]
    )
    assert ours[ours.index("--max-num-seqs") + 1] == "8" == peer[peer.index("-np") + 1]
    assert ours[ours.index("--num-blocks") + 1] == "512" and peer[peer.index("-c") + 1] == "8192"
    assert [count for _, count in RUNS.values()] == [1, 2, 3]


def test_the_startup_phases_are_timed_in_a_fresh_process(tmp_path) -> None:
    from bench.startup import PHASES, measure_phases
    from engine.loader import default_gguf_path

    (seconds,) = measure_phases(default_gguf_path(), 512, tmp_path / "cache", rounds=1)
    assert len(seconds) == len(PHASES)
    assert all(s > 0 for s in seconds)
    assert seconds[1] > 0.1  # importing torch is never free
