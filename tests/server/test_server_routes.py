"""/v1/models, /health, /metrics, /tokenize, /detokenize, /reset_prefix_cache."""

from __future__ import annotations

import time
from typing import Any

import jsonschema_rs
import openai
import pytest

from server.openapi import token_id_key_pattern
from server.request_base import LIMIT_KEY
from server.validation import TOKEN_ID_KEY
from tests.engine.tiny_models import VOCAB_SIZE
from tests.server.conftest import (
    MODEL_NAME,
    TINY_MAX_MODEL_LEN,
    assert_openai_error,
    random_ids,
    wait_until,
)


def test_models_lists_the_served_model(server):
    models = server.openai().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    raw = server.http().get("/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == TINY_MAX_MODEL_LEN
    assert raw["data"][0]["object"] == "model"


def test_models_retrieve_gives_the_served_models_card(server):
    card = server.openai().models.retrieve(MODEL_NAME)
    assert (card.id, card.object, card.owned_by) == (MODEL_NAME, "model", "pagedserve")
    assert server.http().get(f"/v1/models/{MODEL_NAME}").json()["max_model_len"] == 1024


@pytest.mark.parametrize("model", ["gpt-4", "org/other-model"])
def test_models_retrieve_of_another_model_is_404_model_not_found(server, model):
    with pytest.raises(openai.NotFoundError):
        server.openai().models.retrieve(model)
    error = assert_openai_error(server.http().get(f"/v1/models/{model}"), 404, "model")
    assert error["code"] == "model_not_found" and model in error["message"]


def test_health_is_200_while_alive(server):
    assert server.http().get("/health").status_code == 200


def test_metrics_counters_move_after_requests(server):
    prompt = random_ids(seed=301, n=20)
    before = server.metrics()
    server.openai().completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = server.metrics()

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("pagedserve:generation_tokens_total") == 7
    assert delta("pagedserve:prompt_tokens_total") == 20  # a new prefix: nothing cached
    assert delta("pagedserve:prefix_cache_queries_total") == 20
    assert delta("pagedserve:request_success_total", finished_reason="length") == 1
    assert delta("pagedserve:time_to_first_token_seconds_count") == 1
    assert delta("pagedserve:time_per_output_token_seconds_count") == 1
    assert delta("pagedserve:e2e_request_latency_seconds_count") == 1
    assert delta("pagedserve:iteration_tokens_total_sum") == 20 + 6  # the prefill, then 6 decodes
    assert after[("pagedserve:num_requests_running", ())] == 0
    assert after[("pagedserve:kv_cache_usage_perc", ())] == 0


def test_metrics_count_prefix_cache_hits(server):
    prompt = random_ids(seed=302, n=40)  # 2 full blocks
    client = server.openai()
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    before = server.metric("pagedserve:prefix_cache_hits_total")
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    assert server.metric("pagedserve:prefix_cache_hits_total") - before == 32


def test_tokenize_detokenize_roundtrip(server):
    http = server.http()
    out = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert out["count"] == len(out["tokens"]) == 2 and out["max_model_len"] == TINY_MAX_MODEL_LEN
    assert out["token_strs"] == ["Hello", "Ġworld"]
    assert http.post("/detokenize", json={"tokens": out["tokens"]}).json() == {
        "prompt": "Hello world"
    }
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    text = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_reset_prefix_cache_forgets_cached_blocks(server):
    client = server.openai()
    prompt = random_ids(seed=303, n=48)
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    assert server.http().post("/reset_prefix_cache").json() == {"success": True}
    again = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == 0


def test_unknown_fields_are_logged_as_ignored(server, caplog):
    with caplog.at_level("WARNING", logger="server.serving"):
        r = server.http().post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "frobnicate": 3}
        )
    assert r.status_code == 200
    assert any("frobnicate" in rec.getMessage() for rec in caplog.records)


def test_idle_engine_does_not_step(server):
    server.openai().completions.create(model=MODEL_NAME, prompt="warm up", max_tokens=2)
    wait_until(server.all_blocks_free, 30, "request did not finish")
    steps = server.engine.core.stats.num_steps
    time.sleep(0.5)
    assert server.engine.core.stats.num_steps == steps
    assert server.client.is_alive


# ------------------------------------------------------------------------- /openapi.json


@pytest.fixture(scope="module")
def spec(server) -> dict[str, Any]:
    return server.http().get("/openapi.json").json()


def test_openapi_documents_400_errors_not_422(spec):
    text = str(spec)
    assert "'422'" not in text and "HTTPValidationError" not in text
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, method, statuses in [
        ("/v1/completions", "post", ["400", "401", "404", "413", "500", "503"]),
        ("/v1/chat/completions", "post", ["400", "401", "404", "413", "500", "503"]),
        ("/tokenize", "post", ["400", "401", "404", "413"]),
        ("/detokenize", "post", ["400", "401", "404", "413"]),
        ("/v1/models/{model}", "get", ["401", "404"]),
        ("/health", "get", ["503"]),
    ]:
        responses = spec["paths"][path][method]["responses"]
        for status in statuses:
            assert responses[status]["content"]["application/json"]["schema"] == error_ref
    error = spec["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}


def test_openapi_fills_in_this_servers_limits(spec):
    assert LIMIT_KEY not in str(spec)
    schemas = spec["components"]["schemas"]
    detokenize = schemas["DetokenizeRequest"]["properties"]
    assert detokenize["tokens"]["items"]["maximum"] == VOCAB_SIZE - 1
    assert detokenize["model"]["enum"] == [MODEL_NAME, None]
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["max_tokens"]["anyOf"][0]["maximum"] == TINY_MAX_MODEL_LEN - 1
    assert completion["n"]["maximum"] == 128  # MAX_N, below the default 256 sequences
    (model_param,) = spec["paths"]["/v1/models/{model}"]["get"]["parameters"]
    assert model_param["schema"]["enum"] == [MODEL_NAME]


def test_openapi_content_types_are_the_ones_sent(server, spec):
    paths = spec["paths"]
    assert "content" not in paths["/health"]["get"]["responses"]["200"]
    health = server.http().get("/health")
    assert health.content == b"" and "content-type" not in health.headers
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert server.http().get("/metrics").headers["content-type"].startswith("text/plain")
    streamed = paths["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(streamed) == {"application/json", "text/event-stream"}


def request_validator(spec: dict[str, Any], name: str) -> Any:
    return jsonschema_rs.validator_for(
        {"$ref": f"#/components/schemas/{name}", "components": spec["components"]}
    )


# Bodies the spec must accept exactly when the server does.
SPEC_CASES = [
    ("/v1/completions", "CompletionRequest", {"prompt": "hi"}),
    ("/v1/completions", "CompletionRequest", {"prompt": ""}),
    ("/v1/completions", "CompletionRequest", {"prompt": []}),
    ("/v1/completions", "CompletionRequest", {"prompt": [[]]}),
    ("/v1/completions", "CompletionRequest", {"prompt": [VOCAB_SIZE - 1]}),
    ("/v1/completions", "CompletionRequest", {"prompt": [VOCAB_SIZE]}),
    ("/v1/completions", "CompletionRequest", {"prompt": [1] * TINY_MAX_MODEL_LEN}),
    ("/v1/completions", "CompletionRequest", {"prompt": "hi", "model": MODEL_NAME}),
    ("/v1/completions", "CompletionRequest", {"prompt": "hi", "model": "gpt-4"}),
    ("/v1/completions", "CompletionRequest", {"prompt": "hi", "stream": "yes"}),
    ("/v1/completions", "CompletionRequest", {"prompt": "hi", "stream_options": {}}),
    ("/v1/completions", "CompletionRequest", {"prompt": "hi", "logit_bias": {"10": 1}}),
    ("/v1/completions", "CompletionRequest", {"prompt": "hi", "logit_bias": {"1_0": 1}}),
    ("/v1/completions", "CompletionRequest", {"prompt": "hi", "logit_bias": {"-1": 1}}),
    ("/v1/completions", "CompletionRequest", {"prompt": "hi", "repetition_penalty": 1e-300}),
    ("/v1/completions", "CompletionRequest", {"prompt": "hi", "max_tokens": TINY_MAX_MODEL_LEN}),
    ("/v1/completions", "CompletionRequest", {"prompt": "hi", "suffix": None}),
    ("/v1/completions", "CompletionRequest", {"prompt": "hi", "suffix": "x"}),
    ("/v1/completions", "CompletionRequest", {"prompt": "hi", "n": 2.0}),
    ("/v1/chat/completions", "ChatCompletionRequest", {"messages": [{"role": ""}]}),
    ("/v1/chat/completions", "ChatCompletionRequest", {"messages": [{"role": "user"}]}),
    ("/v1/chat/completions", "ChatCompletionRequest",
     {"messages": [{"role": "assistant"}, {"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", "ChatCompletionRequest",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
    ("/v1/chat/completions", "ChatCompletionRequest",
     {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
    ("/v1/chat/completions", "ChatCompletionRequest",
     {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", "ChatCompletionRequest",
     {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}),
    ("/tokenize", "TokenizeRequest", {}),
    ("/tokenize", "TokenizeRequest", {"prompt": "hi"}),
    ("/tokenize", "TokenizeRequest", {"prompt": "hi", "messages": [{"role": "user"}]}),
    ("/tokenize", "TokenizeRequest", {"messages": []}),
    ("/tokenize", "TokenizeRequest", {"prompt": None, "messages": [{"role": "user", "content": "a"}]}),
    ("/detokenize", "DetokenizeRequest", {"tokens": [VOCAB_SIZE]}),
    ("/detokenize", "DetokenizeRequest", {"tokens": [0, VOCAB_SIZE - 1]}),
]  # fmt: skip


@pytest.mark.parametrize(("route", "schema", "body"), SPEC_CASES)
def test_openapi_request_schemas_reject_what_the_server_rejects(spec, server, route, schema, body):
    if route.startswith("/v1"):
        body = {"max_tokens": 1, **body}  # one cheap token when it is served
    response = server.http().post(route, json=body)
    assert response.status_code in (200, 400, 404), response.text
    served = response.status_code == 200
    assert request_validator(spec, schema).is_valid(body) == served, (body, response.text)


def test_openapi_token_id_keys_pattern_matches_the_server_exactly():
    for vocab in (1, 2, 10, 11, 100, 1000, VOCAB_SIZE):
        pattern = jsonschema_rs.validator_for(
            {"type": "string", "pattern": token_id_key_pattern(vocab)}
        )
        keys = [str(i) for i in range(min(vocab + 50, 2000))]
        keys += ["-0", "007", f"0{vocab - 1}", str(vocab), "-1", "1_0", " 1", "+1", "", "\u0663"]
        for key in keys:
            expected = bool(TOKEN_ID_KEY.fullmatch(key)) and 0 <= int(key) < vocab
            assert pattern.is_valid(key) == expected, (vocab, key)
