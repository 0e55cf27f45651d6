"""The naive transformers baseline: greedy, one request at a time, OpenAI-shaped answers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from bench.loadgen import LoadConfig, run_load
from bench.naive_server import NaiveModel, build_app
from bench.workloads import Prompt
from engine.loader import load_reference_model
from tests.server.conftest import _UvicornThread

NAME = "naive-tiny"


@pytest.fixture(scope="module")
def naive(tiny_model_dir: Path) -> NaiveModel:
    return NaiveModel(str(tiny_model_dir), "float32")


@pytest.fixture(scope="module")
def naive_url(naive: NaiveModel) -> Iterator[str]:
    thread = _UvicornThread(build_app(naive, NAME))
    thread.start()
    try:
        yield f"http://127.0.0.1:{thread.port}"
    finally:
        thread.stop()


def greedy_reference(model_dir: Path, prompt_ids: list[int], n: int) -> list[int]:
    model = load_reference_model(model_dir, torch.float32)
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, pad_token_id=2)  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


def test_streamed_and_plain_answers_are_the_greedy_tokens(naive, naive_url, tiny_model_dir):
    prompt = "the quick brown fox"
    ids = naive.tokenizer.encode(prompt)
    expected = naive.tokenizer.decode(greedy_reference(tiny_model_dir, ids, 6),
                                      skip_special_tokens=True)  # fmt: skip
    for stream in (True, False):
        cfg = LoadConfig(base_url=naive_url, max_tokens=6, stream=stream, progress=False)
        run = asyncio.run(run_load(cfg, [Prompt(prompt, 0)]))
        (result,) = run.results
        assert result.ok, result.error
        assert run.model == NAME
        assert result.text == expected
        assert (result.output_tokens, result.prompt_tokens) == (6, len(ids))  # from usage
        assert (result.ttft is not None) == stream


def test_chat_and_errors(naive_url):
    cfg = LoadConfig(base_url=naive_url, endpoint="chat", max_tokens=3, progress=False)
    run = asyncio.run(run_load(cfg, [Prompt("hi", 0), Prompt("hello", 1)]))
    assert [r.ok for r in run.results] == [True, True]
    assert all(r.output_tokens == 3 for r in run.results)
    wrong = httpx.post(f"{naive_url}/v1/completions", json={"model": "x", "prompt": "a"})
    assert wrong.status_code == 404 and "x" in wrong.json()["error"]["message"]
    bad = httpx.post(f"{naive_url}/v1/completions", json={"prompt": "a", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_requests_run_one_at_a_time(naive, naive_url, monkeypatch):
    # The global lock is what makes it the baseline: generations never overlap.
    spans: list[tuple[float, float]] = []
    generate = naive.model.generate

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            spans.append((start, time.perf_counter()))

    monkeypatch.setattr(naive.model, "generate", timed_generate)
    cfg = LoadConfig(base_url=naive_url, max_tokens=8, concurrency=4, progress=False)
    run = asyncio.run(run_load(cfg, [Prompt(f"request {i}", i) for i in range(4)]))
    assert all(r.ok for r in run.results)
    spans.sort()
    assert len(spans) == 4
    assert all(
        end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:], strict=False)
    )
