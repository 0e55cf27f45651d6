"""A model with two eos ids behind the server: every sampling option, and the server lives.

Once, one `min_tokens` request on such a model (Llama 3, Qwen2.5-Instruct) killed the
engine loop for everyone.
"""

from __future__ import annotations

import pytest

from tests.engine.tiny_models import MULTI_EOS_PROMPT, make_multi_eos_model_dir, second_eos_id
from tests.server.conftest import MODEL_NAME, make_engine, running_server


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def multi_eos_server(request, tmp_path_factory):
    path = make_multi_eos_model_dir(tmp_path_factory.mktemp(f"srv-eos-{request.param}"),
                                    request.param)  # fmt: skip
    with running_server(make_engine(path, num_blocks=256)) as server:
        yield server, second_eos_id(path)


SAMPLING_OPTIONS = [
    {"min_tokens": 4},
    {"min_tokens": 4, "stop_token_ids": [5, 7]},
    {"min_tokens": 2, "temperature": 0.9, "seed": 11, "n": 3},
    {"min_tokens": 3, "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.3},
    {"min_tokens": 3, "logprobs": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 4},
    {"min_tokens": 3, "ignore_eos": True},
    {"min_tokens": 2, "logit_bias": {"9": 1.5}, "stream": True},
]


@pytest.mark.parametrize("options", SAMPLING_OPTIONS, ids=lambda o: ",".join(o))
def test_every_sampling_option_on_a_two_eos_model(multi_eos_server, options):
    server, _ = multi_eos_server
    body = {"model": MODEL_NAME, "prompt": MULTI_EOS_PROMPT, "max_tokens": 8, "temperature": 0,
            **options}  # fmt: skip
    with server.http() as http:
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        if options.get("stream"):
            assert response.text.rstrip().endswith("data: [DONE]")
        else:
            choices = response.json()["choices"]
            assert len(choices) == options.get("n", 1)
            assert all(c["finish_reason"] in ("stop", "length") for c in choices)
        assert http.get("/health").status_code == 200  # the engine lives on
    assert server.client.is_alive


def test_a_greedy_completion_stops_at_the_second_eos_unless_min_tokens_holds_it(multi_eos_server):
    server, _ = multi_eos_server
    client = server.openai()
    out = client.completions.create(model=MODEL_NAME, prompt=MULTI_EOS_PROMPT, max_tokens=8,
                                    temperature=0)  # fmt: skip
    # Greedy reaches the second eos as its third token: the request stops there.
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 3
    held = client.completions.create(model=MODEL_NAME, prompt=MULTI_EOS_PROMPT, max_tokens=8,
                                     temperature=0, extra_body={"min_tokens": 5})  # fmt: skip
    assert held.usage.completion_tokens >= 5
