"""A model's chat template is its file's code (issue 64), end to end: one real uvicorn server
of several models (--models-dir), built as `pagedserve serve --models-dir DIR --pin tiny`
builds it, asked through the OpenAI SDK.

- `bomb.gguf`: the default model whose template passes the check at load (it renders the
  default template) but spins, grows a list or multiplies a string past any bound when the
  last message says so, as a hostile file's template could: each such request is a 500 in
  the OpenAI shape naming the model's template, in bounded time, with no traceback; the
  next request is served, and the process's memory comes back.
- `refused.gguf`: a template that hangs on any chat, refused at its load with one line; it
  fails alone (a 503 naming the bound), the other models serve on.
- `tiny`: a normal model, served while `bomb`'s template runs into its time bound (its
  renders run on threads of their own), which answers a request too large for its context
  with a 400.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from engine import EngineConfig
from engine.core import EngineCore
from server.app import build_app
from server.async_engine import AsyncEngine
from server.model_serving import start_models
from server.server_config import ServerConfig
from tests.engine.gguf_models import write_with_chat_template
from tests.engine.tiny_models import default_tokenizer, make_tiny_model_dir
from tests.server.conftest import _UvicornThread, tracebacks

TIMEOUT_S = 2.0  # --chat-template-timeout (its default)
ENGINE = {"dtype": "float32", "device": "cpu", "block_size": 16, "num_blocks": 64,
          "max_num_seqs": 8, "max_num_batched_tokens": 256, "seed": 0, "max_model_len": 1024,
          "chat_template_timeout": TIMEOUT_S}  # fmt: skip
TRIGGERS = (
    "{%- set last = messages[-1]['content'] %}"
    "{%- if last == 'spin' %}{% for i in range(10000) %}{% for j in range(10000) %}"
    "{% endfor %}{% endfor %}{% endif %}"
    "{%- if last == 'grow' %}{% set ns = namespace(l=[]) %}{% for i in range(50000) %}"
    "{% set ns.l = ns.l + ['y' * 50000] %}{% endfor %}{% endif %}"
    "{%- if last == 'multiply' %}{{ 'x' * 10000000000 }}{% endif %}"
)
HANGS = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"
BOUND_OF = {"spin": "time", "grow": "memory", "multiply": "value size"}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    root = tmp_path_factory.mktemp("models")
    write_with_chat_template(root / "bomb.gguf", TRIGGERS + default_tokenizer().chat_template)
    write_with_chat_template(root / "refused.gguf", HANGS, weights=False)  # never read
    make_tiny_model_dir(root / "tiny", max_position_embeddings=1024)

    def load(config: EngineConfig, tokenizer: Any) -> AsyncEngine:  # the CLI's loader
        return AsyncEngine.load(lambda: EngineCore.from_config(config, tokenizer=tokenizer),
                                log_interval_s=60)  # fmt: skip

    engine = EngineConfig(**ENGINE, cache_dir=str(tmp_path_factory.mktemp("cache")))
    client, router = start_models(ServerConfig(models_dir=str(root), pin=("tiny",)), engine,
                                  (), load)  # fmt: skip
    thread = _UvicornThread(build_app(client, models=router, chat_template_timeout=TIMEOUT_S))
    thread.start()
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{thread.port}/v1", api_key="unused",
                            max_retries=0, timeout=60)  # fmt: skip
    finally:
        thread.stop()


def _chat(sdk: openai.OpenAI, model: str, content: str) -> Any:
    return sdk.chat.completions.create(model=model, max_tokens=2, temperature=0,
                                       messages=[{"role": "user", "content": content}])  # fmt: skip


def test_a_bomb_is_a_500_naming_the_template_in_bounded_time_and_the_next_is_served(
    server, server_log
):
    assert _chat(server, "bomb", "Hi").choices[0].message.content is not None
    idle = _rss_mib()
    for trigger, bound in BOUND_OF.items():
        start = time.monotonic()
        with pytest.raises(openai.InternalServerError) as failed:
            _chat(server, "bomb", trigger)
        assert time.monotonic() - start < TIMEOUT_S + 5
        error = failed.value.body
        assert failed.value.status_code == 500 and error["code"] == "chat_template_bound"
        assert error["type"] == "server_error" and f"({bound} bound)" in error["message"]
        assert "The chat template of model bomb" in error["message"]
        assert _chat(server, "bomb", "Hi").choices[0].finish_reason == "length"  # served
        assert _rss_mib() < idle * 1.1, f"RSS {idle:.0f} -> {_rss_mib():.0f} MiB after {trigger}"
    assert not tracebacks(server_log)
    warnings = [r.getMessage() for r in server_log if "chat template of model bomb" in
                r.getMessage()]  # fmt: skip
    assert len(warnings) == len(BOUND_OF)


def test_while_one_models_template_spins_the_server_and_other_models_serve(server):
    spun: list[float] = []

    def spin() -> None:
        with pytest.raises(openai.InternalServerError):
            _chat(server, "bomb", "spin")
        spun.append(time.monotonic())

    spinning = threading.Thread(target=spin)
    spinning.start()
    time.sleep(0.1)  # its render is running
    start = time.monotonic()
    answer = _chat(server, "tiny", "Hi")  # ~150 ms beside the spin, ~20 ms alone
    served = time.monotonic()
    spinning.join(30)
    assert answer.model == "tiny" and spun
    assert served < spun[0], f"another model's request waited {served - start:.2f} s for it"


def test_a_request_too_large_for_the_context_is_a_400(server):
    # tiny's context takes a prompt of at most 1,024 tokens of 81 bytes
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(server, "tiny", "x" * 90_000)
    assert refused.value.body["code"] == "chat_template_bound"
    assert refused.value.body["param"] == "messages"
    assert "82,944 bytes" in refused.value.body["message"]


def test_a_model_whose_template_fails_at_load_fails_alone(server, server_log):
    with pytest.raises(openai.APIStatusError) as failed:
        _chat(server, "refused", "Hi")
    assert failed.value.status_code == 503 and failed.value.body["code"] == "model_load_failed"
    assert "ran for more than its 2 s time bound rendering a probe chat" in failed.value.message
    assert _chat(server, "tiny", "Hi").model == "tiny"
    assert _chat(server, "bomb", "Hi").model == "bomb"
    assert not tracebacks(server_log)
