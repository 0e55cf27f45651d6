"""A live pagedserve (uvicorn on 127.0.0.1, tiny random model) for the load generator tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.tiny_models import default_tokenizer, make_tiny_model_dir
from tests.server.conftest import TINY_MAX_MODEL_LEN, RunningServer, make_engine, running_server


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench-tiny-model")
    return make_tiny_model_dir(path, max_position_embeddings=TINY_MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with running_server(make_engine(tiny_model_dir)) as s:
        yield s


@pytest.fixture(scope="session")
def tokenizer():
    return default_tokenizer()
