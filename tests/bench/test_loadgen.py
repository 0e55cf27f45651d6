"""The load generator: SSE parsing on canned streams, then runs against a live pagedserve."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from bench.loadgen import (
    LoadConfig,
    arrival_delays,
    request_body,
    run_load,
    send_request,
)
from bench.runner import run_point
from bench.workloads import Prompt, WorkloadSpec, build_conversations

RECORD_FIELDS = {
    "requests", "errors", "error_messages", "duration_s", "request_throughput",
    "output_throughput", "total_token_throughput", "prompt_tokens", "output_tokens",
    "cached_tokens", "ttft_ms", "itl_ms", "e2e_ms", "server_metrics", "load_avg_1m",
    "workload", "concurrency", "max_tokens", "model",
}  # fmt: skip


# ------------------------------------------------------------------ canned server answers


def sse(*events: object) -> bytes:
    return "".join(
        f"data: {json.dumps(e) if not isinstance(e, str) else e}\n\n" for e in events
    ).encode()


def send_canned(handler, cfg: LoadConfig | None = None, body: dict | None = None):
    cfg = cfg or LoadConfig(base_url="http://test")

    async def go():
        async with httpx.AsyncClient(
            base_url="http://test", transport=httpx.MockTransport(handler)
        ) as client:
            return await send_request(client, cfg, body or request_body(cfg, "m", "hi"))

    return asyncio.run(go())


def test_a_stream_gives_ttft_gaps_text_and_usage():
    usage = {"prompt_tokens": 7, "completion_tokens": 3,
             "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
    stream = sse(
        {"choices": [{"index": 0, "text": "a"}]},
        {"choices": [{"index": 0, "text": ""}]},  # an empty chunk is no token
        {"choices": [{"index": 0, "text": "b"}]},
        {"choices": [{"index": 0, "text": "c", "finish_reason": "length"}]},
        {"choices": [], "usage": usage},
        "[DONE]",
    )
    result = send_canned(lambda request: httpx.Response(200, content=stream))
    assert result.ok and result.error is None
    assert result.text == "abc"
    assert result.ttft is not None and result.ttft <= result.latency
    assert len(result.itl) == 2  # gaps between the three text chunks
    assert (result.prompt_tokens, result.output_tokens, result.cached_tokens) == (7, 3, 4)


def test_without_usage_each_text_chunk_counts_as_a_token():
    chat = LoadConfig(base_url="http://test", endpoint="chat")
    stream = sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"content": "x"}}]},
        {"choices": [{"index": 0, "delta": {"content": "y"}}]},
        "[DONE]",
    )
    result = send_canned(lambda request: httpx.Response(200, content=stream), chat)
    assert result.ok and result.text == "xy"
    assert (result.output_tokens, result.prompt_tokens, result.cached_tokens) == (2, None, None)


def test_http_errors_error_events_and_broken_json_are_results_not_exceptions():
    error = {"error": {"message": "max_tokens is too large", "type": "BadRequestError"}}
    bad = send_canned(lambda request: httpx.Response(400, json=error))
    assert not bad.ok and bad.error == "HTTP 400: max_tokens is too large"

    mid_stream = sse({"choices": [{"text": "a"}]}, {"error": {"message": "engine died"}})
    died = send_canned(lambda request: httpx.Response(200, content=mid_stream))
    assert not died.ok and "engine died" in died.error

    garbage = send_canned(lambda request: httpx.Response(200, content=b"data: {oops\n\n"))
    assert not garbage.ok and garbage.error.startswith("JSONDecodeError")


def test_request_body_options():
    cfg = LoadConfig(max_tokens=5, extra_body={"min_tokens": 5})
    body = request_body(cfg, "m", "hello")
    assert body["prompt"] == "hello" and body["model"] == "m" and body["temperature"] == 0.0
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] and body["min_tokens"] == 5 and body["max_tokens"] == 5
    plain = request_body(LoadConfig(endpoint="chat", stream=False, ignore_eos=False), None, [])
    assert plain["messages"] == [] and "model" not in plain
    assert not {"stream", "stream_options", "ignore_eos"} & set(plain)


def test_poisson_arrivals_are_seeded():
    gaps = arrival_delays(200, rate=4.0, seed=1)
    assert gaps == arrival_delays(200, rate=4.0, seed=1) != arrival_delays(200, 4.0, seed=2)
    assert all(g > 0 for g in gaps) and 0.15 < sum(gaps) / len(gaps) < 0.4  # mean 1/rate
    assert arrival_delays(3, rate=None, seed=1) == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------------- a live pagedserve


def test_shared_prefix_run_record(server, tokenizer):
    cfg = LoadConfig(base_url=server.url, max_tokens=4, concurrency=2, progress=False)
    spec = WorkloadSpec("shared-prefix", num_requests=6, prefix_len=48, num_prefixes=2)
    point = run_point(cfg, spec, tokenizer, server="pagedserve")
    r = point.record
    assert set(r) >= RECORD_FIELDS
    assert (r["requests"], r["errors"], r["error_messages"]) == (6, 0, [])
    assert r["output_tokens"] == 6 * 4  # ignore_eos: every request makes max_tokens
    assert r["model"] == "tiny-test-model"  # found through /v1/models
    assert r["prompt_tokens"] >= 6 * 48
    assert r["cached_tokens"] > 0  # later requests of a group hit the prefix cache
    assert len(point.ttfts) == 6
    assert all(r["ttft_ms"][q] is not None for q in ("p50", "p90", "p99"))
    assert r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] <= r["e2e_ms"]["p99"]
    assert r["itl_ms"]["p50"] is not None and r["output_throughput"] > 0
    metrics = r["server_metrics"]
    assert metrics["generation_tokens"] == 24
    assert 1 <= metrics["mean_requests_per_step"] <= 2  # concurrency 2
    assert 0 < metrics["prefix_cache_hit_rate"] < 1


def test_unstreamed_run_counts_tokens_from_usage(server, tokenizer):
    cfg = LoadConfig(base_url=server.url, max_tokens=3, stream=False, progress=False)
    r = run_point(cfg, WorkloadSpec("unique", num_requests=3, prefix_len=20), tokenizer).record
    assert (r["requests"], r["errors"], r["output_tokens"]) == (3, 0, 9)
    assert r["ttft_ms"]["p50"] is None  # no stream, no first-token time
    assert r["e2e_ms"]["p50"] is not None


def test_failing_requests_are_counted_with_their_messages(server, tokenizer):
    spec = WorkloadSpec("unique", num_requests=7, prefix_len=10)
    bad_model = LoadConfig(base_url=server.url, model="no-such-model", progress=False)
    r = run_point(bad_model, spec, tokenizer).record
    assert (r["requests"], r["errors"]) == (0, 7)
    assert len(r["error_messages"]) == 5  # the first few only
    assert all(m.startswith("HTTP 404") and "no-such-model" in m for m in r["error_messages"])
    assert r["output_throughput"] == 0 and r["ttft_ms"]["p50"] is None

    too_long = LoadConfig(base_url=server.url, max_tokens=10**6, progress=False)
    r = run_point(too_long, WorkloadSpec("unique", num_requests=2, prefix_len=10), tokenizer).record
    assert (r["requests"], r["errors"]) == (0, 2)
    assert r["error_messages"][0].startswith("HTTP 400")


def test_some_requests_failing_do_not_stop_the_others(server):
    cfg = LoadConfig(base_url=server.url, max_tokens=2, progress=False)
    # a prompt longer than the context (1024) is refused; the others still run
    prompts = [Prompt("hello there", 0), Prompt("word " * 2000, 1), Prompt("general kenobi", 2)]
    run = asyncio.run(run_load(cfg, prompts))
    assert [r.ok for r in run.results] == [True, False, True]
    assert run.results[1].error.startswith("HTTP 400")


def test_an_unreachable_server_is_an_error_per_request(tokenizer):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    cfg = LoadConfig(base_url=url, progress=False, timeout_s=5)
    r = run_point(cfg, WorkloadSpec("unique", num_requests=2, prefix_len=5), tokenizer).record
    assert (r["requests"], r["errors"]) == (0, 2)
    assert r["error_messages"][0].startswith("ConnectError")
    assert r["server_metrics"] is None


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_multi_turn_resends_the_history_with_the_answers(server, tokenizer, endpoint):
    spec = WorkloadSpec("multi-turn", num_requests=6, prefix_len=32, turns=3)
    cfg = LoadConfig(base_url=server.url, endpoint=endpoint, max_tokens=3, concurrency=2,
                     progress=False)  # fmt: skip
    run = asyncio.run(run_load(cfg, build_conversations(spec, tokenizer)))
    assert len(run.results) == 6 and all(r.ok for r in run.results)
    first, second, third = run.results[:3]  # one conversation's turns, in order
    if endpoint == "chat":
        assert second.prompt[1] == {"role": "assistant", "content": first.text}
        assert third.prompt[:3] == second.prompt
    else:
        assert second.prompt.startswith(first.prompt + first.text)
        assert third.prompt.startswith(second.prompt + second.text)
    # the history is resent, so later turns find it in the prefix cache
    assert (third.cached_tokens or 0) > 0


def test_bench_command_prints_a_record_per_level_and_writes_the_file(
    server, tiny_model_dir, tmp_path, capsys
):
    from bench.cli import main

    out = tmp_path / "records.json"
    code = main([
        "--base-url", server.url, "--tokenizer", str(tiny_model_dir), "--workload",
        "unique,shared-prefix", "--concurrency", "1,3", "--num-requests", "3",
        "--prefix-len", "20", "--max-tokens", "2", "--output", str(out), "--no-progress",
    ])  # fmt: skip
    assert code == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # level i of a sweep uses seed + i: new prompts at each level
    assert [(r["workload"], r["concurrency"], r["seed"]) for r in printed] == [
        ("unique", 1, 0),
        ("unique", 3, 1),
        ("shared-prefix", 1, 0),
        ("shared-prefix", 3, 1),
    ]
    assert all((r["requests"], r["errors"], r["output_tokens"]) == (3, 0, 6) for r in printed)
    assert json.loads(out.read_text()) == printed
