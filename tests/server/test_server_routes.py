"""/v1/models, /health, /metrics, /tokenize, /detokenize, /reset_prefix_cache."""

from __future__ import annotations

import time

from tests.server.conftest import MODEL_NAME, TINY_MAX_MODEL_LEN, random_ids, wait_until


def test_models_lists_the_served_model(server):
    models = server.openai().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    raw = server.http().get("/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == TINY_MAX_MODEL_LEN
    assert raw["data"][0]["object"] == "model"


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
    steps = server.engine.stats.num_steps
    time.sleep(0.5)
    assert server.engine.stats.num_steps == steps
    assert server.client.is_alive
