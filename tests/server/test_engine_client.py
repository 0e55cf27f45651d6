"""Both engine clients implement the one `EngineClient` protocol the app is written
against, and their streams the `EngineStream` protocol; the app's modules import neither
implementation."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from server.async_engine import AsyncEngine, RequestStream
from server.engine_client import EngineClient, EngineStream
from tests.engine.tiny_models import default_tokenizer

from .conftest import make_engine

SERVER = Path(__file__).resolve().parents[2] / "server"
# The composition roots build a client; everything else speaks the protocol.
BUILDERS = {"cli.py", "async_engine.py", "replicas/deployment.py", "replicas/remote_engine.py"}


def protocol_members(protocol: type) -> set[str]:
    names = set(vars(protocol)) | set(protocol.__annotations__)
    return {n for n in names if not n.startswith("_")}


def test_the_in_process_engine_is_an_engine_client(tiny_model_dir):
    client = AsyncEngine(make_engine(tiny_model_dir, num_blocks=32).core)
    assert isinstance(client, EngineClient)
    assert isinstance(RequestStream(client, ["a"]), EngineStream)
    for name in protocol_members(EngineClient):
        member = inspect.getattr_static(AsyncEngine, name, None)
        if inspect.iscoroutinefunction(getattr(EngineClient, name, None)):
            assert inspect.iscoroutinefunction(member), name


def test_the_replicas_engine_is_an_engine_client():
    from server.replicas.remote_engine import RemoteEngine, RemoteStream

    class Handle:
        def options(self, **_: object) -> Handle:
            return self

    facts = {"model_name": "m", "max_model_len": 64, "vocab_size": 49152, "eos_token_ids": [2]}
    client = RemoteEngine(Handle(), default_tokenizer(), facts)
    assert isinstance(client, EngineClient)
    assert isinstance(RemoteStream(None, ["a"], lambda: None), EngineStream)
    for name in protocol_members(EngineClient):
        if inspect.iscoroutinefunction(getattr(EngineClient, name, None)):
            assert inspect.iscoroutinefunction(getattr(RemoteEngine, name)), name


def test_the_app_imports_only_the_protocol():
    for path in SERVER.rglob("*.py"):
        if str(path.relative_to(SERVER)) in BUILDERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module not in (
                    "server.async_engine",
                    "server.replicas.remote_engine",
                ), f"{path.relative_to(SERVER)} imports {node.module}: use server.engine_client"
