"""Several models behind one server (--models-dir): routing by `model`, load on first use,
the LRU unload within --max-loaded-models, a drained unload, the load/unload routes, a
pinned model, an unknown model, a load that fails and one too large for the budget.

One real uvicorn server over a directory of tiny random models (alpha, beta, gamma: the
same shape, other weights), built as `pagedserve serve --models-dir DIR --pin alpha
--max-loaded-models 2 --models-memory 1GiB` builds it, with the loader gated so a test
can hold a load midway. Each test leaves beta and gamma in any state, and puts them in
the state it needs first (xdist may run them in any order).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine import EngineConfig
from engine.core import EngineCore
from server.app import build_app
from server.async_engine import AsyncEngine
from server.cli import build_parser
from server.model_router import ModelRouter
from server.model_serving import several_models, start_models
from server.server_config import ServerConfig
from tests.engine.tiny_models import make_tiny_model_dir
from tests.server.conftest import _UvicornThread, assert_openai_error, random_ids, wait_until

ENGINE = {"dtype": "float32", "device": "cpu", "block_size": 16, "num_blocks": 64,
          "max_num_seqs": 8, "max_num_batched_tokens": 256, "seed": 0}  # fmt: skip
GiB = 1 << 30
REPO = Path(__file__).resolve().parents[2]


class GatedLoader:
    """The CLI's loader (the core built on its engine thread), held at a gate per model."""

    def __init__(self) -> None:
        self.gates: dict[str, threading.Event] = {}

    def __call__(self, config: EngineConfig, tokenizer: Any) -> AsyncEngine:
        gate = self.gates.get(Path(config.model or "").name)
        if gate is not None:
            assert gate.wait(120), "the test never opened the gate"
        build = lambda: EngineCore.from_config(config, tokenizer=tokenizer)  # noqa: E731
        return AsyncEngine.load(build, log_interval_s=60)


class Server:
    def __init__(self, url: str, router: ModelRouter, loader: GatedLoader) -> None:
        self.url, self.router, self.loader = url, router, loader
        self.http = httpx.Client(base_url=url, timeout=60)
        self.sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def states(self) -> dict[str, dict[str, Any]]:
        body = self.http.get("/v1/models").json()
        assert body["object"] == "list"
        return {card["id"]: card["status"] for card in body["data"]}

    def complete(self, model: str, max_tokens: int = 3) -> Any:
        return self.sdk.completions.create(model=model, prompt=random_ids(7, 12),
                                           max_tokens=max_tokens, temperature=0)  # fmt: skip

    def unload_quietly(self, model: str) -> None:
        self.http.post("/models/unload", json={"model": model})  # a 400 if it is not loaded

    def metric(self, name: str, **labels: str) -> float:
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                found = dict(p.split("=", 1) for p in line[line.find("{") + 1 : line.rfind("}")]
                             .replace('"', "").split(",") if "=" in p)  # fmt: skip
                if all(found.get(k) == v for k, v in labels.items()):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for seed, name in enumerate(("alpha", "beta", "gamma")):
        make_tiny_model_dir(root / name, seed=seed)
    (root / "broken").mkdir()  # a folder whose load fails: no weights
    (root / "broken" / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    huge = root / "huge"  # a model larger than the whole budget (a sparse weights file)
    huge.mkdir()
    (huge / "config.json").write_text((root / "alpha" / "config.json").read_text())
    with open(huge / "model.safetensors", "wb") as f:
        f.truncate(2 * GiB)
    (root / "notes.txt").write_text("not a model")
    return root


@pytest.fixture(scope="module")
def server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = ServerConfig(models_dir=str(models_dir), max_loaded_models=2,
                          models_memory=GiB, pin=("alpha",))  # fmt: skip
    loader = GatedLoader()
    # Each model with a KV tier of its own, under a cache dir of this test's.
    tiers = {"kv_offload_bytes": 4 << 20, "cache_dir": str(tmp_path_factory.mktemp("cache"))}
    client, router = start_models(config, EngineConfig(**ENGINE, **tiers), (), loader)
    thread = _UvicornThread(build_app(client, models=router))
    thread.start()
    try:
        yield Server(f"http://127.0.0.1:{thread.port}", router, loader)
    finally:
        thread.stop()


def test_the_models_are_listed_with_their_states(server: Server) -> None:
    states = server.states()
    assert set(states) == {"alpha", "beta", "broken", "gamma", "huge"}  # notes.txt is none
    alpha = states["alpha"]
    assert (alpha["value"], alpha["default"], alpha["pinned"]) == ("loaded", True, True)
    assert not states["gamma"]["default"] and not states["gamma"]["pinned"]
    assert states["huge"]["memory_bytes"] > 2 * GiB  # its weights and its KV pool
    card = server.http.get("/v1/models/alpha").json()
    assert (card["id"], card["object"], card["status"]["value"]) == ("alpha", "model", "loaded")
    assert server.http.get("/v1/models/alpha.gguf").json()["id"] == "alpha"  # a file's name
    assert server.http.get("/models").json()["data"][0]["id"] == "alpha"  # llama-server's route
    schema = server.http.get("/openapi.json").json()["components"]["schemas"]
    assert "gamma" in schema["CompletionRequest"]["properties"]["model"]["enum"]  # all named


def test_an_unknown_model_is_an_openai_404(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        server.complete("no-such-model")
    assert caught.value.code == "model_not_found"
    assert "alpha" in caught.value.message  # it names what is served
    assert_openai_error(server.http.get("/v1/models/no-such-model"), 404)
    assert_openai_error(server.http.post("/models/load", json={"model": "nope"}), 404, "model")


def test_requests_route_by_model_and_load_on_first_use(server: Server) -> None:
    server.unload_quietly("beta")
    loads = server.metric("pagedserve:model_loads_total", model="beta")
    a, b = server.complete("alpha"), server.complete("beta")
    assert (a.model, b.model) == ("alpha", "beta")
    assert a.choices[0].text != b.choices[0].text  # other weights: another engine answered
    assert server.complete("beta").choices[0].text == b.choices[0].text
    assert server.states()["beta"]["value"] == "loaded"
    assert server.metric("pagedserve:model_loads_total", model="beta") == loads + 1
    # Each engine's series, labelled with its model; its pool has every block back.
    assert server.metric("pagedserve:generation_tokens_total", model="beta") >= 6
    kv = server.router.registry.named("beta").client.core.kv_cache_manager
    wait_until(lambda: kv.num_free_blocks == kv.num_blocks, 60, "beta's blocks come back")
    # /reset_prefix_cache resets every loaded model's cache, beta's too.
    prompt = random_ids(12, 40)
    server.sdk.completions.create(model="beta", prompt=prompt, max_tokens=2)
    assert server.http.post("/reset_prefix_cache").json()["success"] is True
    again = server.sdk.completions.create(model="beta", prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 0


def test_a_load_keeps_the_other_models_serving(server: Server) -> None:
    server.unload_quietly("gamma")
    gate = server.loader.gates["gamma"] = threading.Event()
    answers: list[Any] = []
    waiting = threading.Thread(target=lambda: answers.append(server.complete("gamma")))
    waiting.start()
    try:
        wait_until(lambda: server.states()["gamma"]["value"] == "loading", 60, "gamma loads")
        assert server.complete("alpha").model == "alpha"  # served while gamma loads
        assert not answers and server.states()["gamma"]["value"] == "loading"
    finally:
        gate.set()
        del server.loader.gates["gamma"]
        waiting.join(120)
    assert answers and answers[0].model == "gamma"  # the request that waited is answered


def test_past_max_loaded_models_the_least_recently_used_unloads(server: Server) -> None:
    server.unload_quietly("gamma")
    server.complete("beta")  # alpha (pinned) + beta: the budget's two models
    # A constrained request waits for beta's grammar compiler, whose warm-up (on its
    # compile thread) holds the engine core while it runs.
    server.sdk.completions.create(model="beta", prompt=random_ids(13, 8), max_tokens=2,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})  # fmt: skip
    unloads = server.metric("pagedserve:model_unloads_total", model="beta")
    beta_core = weakref.ref(server.router.registry.named("beta").client.core)
    assert server.complete("gamma").model == "gamma"
    states = server.states()
    assert (states["alpha"]["value"], states["beta"]["value"], states["gamma"]["value"]) == (
        "loaded", "unloaded", "loaded")  # fmt: skip
    assert server.metric("pagedserve:model_unloads_total", model="beta") == unloads + 1
    assert server.metric("pagedserve:models_loaded") == 2
    # Nothing holds the unloaded engine, not even a reference cycle: its memory is given
    # back at once, without a garbage collection.
    assert beta_core() is None


def test_an_unload_drains_the_requests_in_flight(server: Server, server_log: list) -> None:
    server.complete("beta")  # loaded (gamma, if loaded, makes room)
    stream = server.sdk.completions.create(
        model="beta", prompt=random_ids(8, 12), max_tokens=200, temperature=0,
        extra_body={"ignore_eos": True}, stream=True,
    )  # fmt: skip
    chunks = [next(iter(stream))]  # it is in flight now
    unloaded = server.http.post("/models/unload", json={"model": "beta"})
    chunks += list(stream)
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.json()["model"]["status"]["value"] == "unloaded"
    assert chunks[-1].choices[0].finish_reason == "length"  # never cut
    assert sum(len(c.choices[0].text) > 0 for c in chunks) > 100
    drains = [r.getMessage() for r in server_log if "unloading model beta" in r.getMessage()]
    assert drains and "1 request(s) to finish first" in drains[-1]


def test_a_model_finds_its_prefix_cache_in_its_tier_when_it_returns(server: Server) -> None:
    server.complete("gamma")
    prompt = random_ids(11, 70)  # 4 full blocks of 16 tokens
    first = server.sdk.completions.create(model="gamma", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    tokenizer = server.router.registry.named("gamma").client.tokenizer
    assert server.http.post("/models/unload", json={"model": "gamma"}).status_code == 200
    again = server.sdk.completions.create(model="gamma", prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 64  # saved at unload, reread
    assert server.router.registry.named("gamma").client.tokenizer is tokenizer  # kept, not reread


def test_the_load_and_unload_routes(server: Server) -> None:
    server.unload_quietly("gamma")
    loaded = server.http.post("/models/load", json={"model": "gamma"})
    assert loaded.status_code == 200 and loaded.json()["success"] is True
    assert loaded.json()["model"]["status"]["value"] == "loaded"
    assert server.http.post("/models/unload", json={"model": "gamma"}).status_code == 200
    assert server.states()["gamma"]["value"] == "unloaded"
    error = assert_openai_error(server.http.post("/models/unload", json={"model": "gamma"}), 400)
    assert error["code"] == "model_not_loaded"
    pinned = server.http.post("/models/unload", json={"model": "alpha"})
    assert assert_openai_error(pinned, 400, "model")["code"] == "model_pinned"
    assert server.complete("alpha").model == "alpha"  # still there
    assert_openai_error(server.http.post("/models/load", json={}), 400)


@pytest.mark.parametrize("route", ["/models/load", "/models/unload"])
def test_hostile_bodies_on_the_model_routes_are_openai_4xx(server: Server, route: str) -> None:
    """A body nested 1,000 levels, a wrong type, a huge number and an empty body: each a 4xx
    in the OpenAI shape, and no model's blocks held afterwards."""
    bodies = [
        b'{"model": ' + b"[" * 1000 + b"]" * 1000 + b"}",
        b'{"model": 7}',
        b'{"model": ' + b"9" * 5000 + b"}",
        b"",
    ]
    for body in bodies:
        response = server.http.post(
            route, content=body, headers={"content-type": "application/json"}
        )
        assert 400 <= response.status_code < 500, (body[:40], response.text[:200])
        assert_openai_error(response, response.status_code)
    for entry in server.router.registry:
        if entry.client is not None:
            manager = entry.client.core.kv_cache_manager
            assert manager.num_free_blocks == entry.client.core.num_blocks


def test_a_model_that_fails_to_load_fails_alone(server: Server) -> None:
    failures = server.metric("pagedserve:model_load_failures_total", model="broken")
    with pytest.raises(openai.APIStatusError) as caught:
        server.complete("broken")
    assert caught.value.status_code == 503 and caught.value.code == "model_load_failed"
    assert "safetensors" in caught.value.message and "\n" not in caught.value.message
    status = server.states()["broken"]
    assert status["value"] == "failed" and "safetensors" in status["error"]
    assert server.complete("alpha").model == "alpha"  # the others keep serving
    with pytest.raises(openai.APIStatusError):  # failed stays failed until /models/load
        server.complete("broken")
    assert server.metric("pagedserve:model_load_failures_total", model="broken") >= failures + 1
    retried = server.http.post("/models/load", json={"model": "broken"})
    assert assert_openai_error(retried, 503, "model")["code"] == "model_load_failed"


def test_a_model_larger_than_the_budget_is_refused(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        server.complete("huge")
    assert caught.value.code == "model_too_large"
    assert "--models-memory" in caught.value.message
    assert server.states()["huge"]["value"] == "failed"
    assert server.states()["alpha"]["value"] == "loaded"  # nothing was unloaded for it


def test_the_flags() -> None:
    args = build_parser().parse_args(["serve", "--model", "a.gguf", "--model", "b.gguf"])
    assert (args.models, args.model) == (["a.gguf", "b.gguf"], "a.gguf")
    assert several_models(ServerConfig(), args.models) == ("a.gguf", "b.gguf")
    assert several_models(ServerConfig(), ["a.gguf"]) is None  # one model: as ever
    assert several_models(ServerConfig(models_dir="/m"), None) == ()
    for bad in ({"pin": ("a",)}, {"max_loaded_models": 2}, {"models_memory": GiB}):
        with pytest.raises(ValueError, match="needs --models-dir"):
            several_models(ServerConfig(**bad), ["a.gguf"])
    with pytest.raises(ValueError, match="served_model_name"):
        several_models(ServerConfig(models_dir="/m", served_model_name="x"), None)
    assert not hasattr(build_parser().parse_args(["serve"]), "models")


def test_the_serve_command_serves_each_model_given(models_dir: Path) -> None:
    """`pagedserve serve --model A --model B`: the CLI's path, in a process of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "--model", str(models_dir / "beta"), "--model",
         str(models_dir / "alpha"), "--max-loaded-models", "1", "--port", str(port),
         "--log-level", "warning", "--dtype", "float32", "--num-blocks", "64"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: _healthy(url) or proc.poll() is not None, 120, "no server")
        answer = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "alpha", "prompt": random_ids(9, 8), "max_tokens": 2})  # fmt: skip
        assert answer.status_code == 200 and answer.json()["model"] == "alpha", answer.text
        states = {c["id"]: c["status"] for c in httpx.get(f"{url}/v1/models").json()["data"]}
        assert set(states) == {"alpha", "beta"} and states["beta"]["default"]
        assert (states["alpha"]["value"], states["beta"]["value"]) == ("loaded", "unloaded")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        output = proc.stdout.read()
        assert "2 models (beta, alpha), default beta" in output, output
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


def test_the_dashboard_shows_the_loaded_model_it_names(server: Server) -> None:
    server.sdk.completions.create(model="beta", prompt=random_ids(14, 40), max_tokens=2)
    beta = server.http.get("/dashboard/state", params={"model": "beta"}).json()
    alpha = server.http.get("/dashboard/state").json()  # the default model's
    queries = server.metric("pagedserve:prefix_cache_queries_total", model="beta")
    assert beta["prefix_cache"]["queries"] == queries != alpha["prefix_cache"]["queries"]
    assert beta["num_blocks"] == 64
    assert_openai_error(server.http.get("/dashboard/state", params={"model": "nope"}), 404)
    server.unload_quietly("gamma")
    unloaded = server.http.get("/dashboard/state", params={"model": "gamma"})
    assert assert_openai_error(unloaded, 503, "model")["code"] == "model_not_loaded"
    assert server.http.get("/dashboard", params={"model": "beta"}).status_code == 200
    assert_openai_error(server.http.get("/dashboard/state", params={"x": "1"}), 400, "x")
