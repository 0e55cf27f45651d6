"""GET /dashboard and /dashboard/state on a live server (the page in a browser:
test_dashboard_browser.py), and the block gauges of /metrics they must agree with."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from server.dashboard import PREVIEW_CHARS, SNAPSHOT_INTERVAL_S
from tests.engine.tiny_models import make_tiny_model_dir
from tests.server.conftest import (
    RunningServer,
    assert_openai_error,
    make_engine,
    running_server,
    wait_until,
)

API_KEY = "dashboard-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NUM_BLOCKS = 256
SHARED = "You are a terse assistant. <b>Bold</b> & <script>x</script> answers only. " * 2


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[RunningServer]:
    with running_server(make_engine(tiny_model_dir, num_blocks=NUM_BLOCKS), api_key=API_KEY) as s:
        yield s


def state(server: RunningServer, fresh: bool = True) -> dict:
    """/dashboard/state; `fresh`: wait out the snapshot interval first, so it is taken now."""
    if fresh:
        time.sleep(SNAPSHOT_INTERVAL_S)
    response = server.http(headers=AUTH).get("/dashboard/state")
    assert response.status_code == 200, response.text
    assert response.headers["cache-control"] == "no-store"
    return response.json()


def block_gauges(server: RunningServer) -> dict[str, float]:
    samples = server.metrics()
    gauges = {
        state: samples[("pagedserve:kv_cache_blocks", (("state", state), ("tier", "pool")))]
        for state in ("free", "cached", "in_use")
    }
    gauges["total"] = samples[("pagedserve:kv_cache_num_blocks", (("tier", "pool"),))]
    return gauges


def complete(server: RunningServer, prompt: str, max_tokens: int = 4) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens}
    response = server.http(headers=AUTH).post("/v1/completions", json=body)
    assert response.status_code == 200, response.text


def test_a_fresh_server_shows_an_all_free_pool(tiny_model_dir):
    with running_server(make_engine(tiny_model_dir, num_blocks=64)) as fresh:
        s = state(fresh, fresh=False)
        assert s["blocks"] == {"free": 64, "cached": 0, "in_use": 0} and s["groups"] == []
        assert s["block_states"] == "f" * 64 and s["num_blocks"] == 64
        assert s["prefixes"] == [] and s["prefix_cache"]["hit_rate"] == 0
        assert s["requests"] == {"running": 0, "waiting": 0}
        assert s["tier"] == "pool" and s["block_size"] == 16
        assert s["speculation"] is None  # off
        # /metrics has the pool before any step too.
        assert block_gauges(fresh) == {"free": 64, "cached": 0, "in_use": 0, "total": 64}
        # The execution plan: the start-up line on the page, its fields in /metrics' info.
        assert s["plan"].startswith("attention ") and "weights: projections" in s["plan"]
        ((name, labels),) = [k for k in fresh.metrics() if k[0] == "pagedserve:execution_plan_info"]
        plan = dict(labels)
        assert plan["attention"] in s["plan"] and plan["weights"] in s["plan"]
        assert plan["device"] == "cpu" and plan["dtype"] in ("float32", "bfloat16")


def test_the_page_is_self_contained_html_and_open_without_the_key(server):
    response = server.http().get("/dashboard")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    assert '<canvas id="pool"' in page and "/state" in page
    # No external assets: the machine serving it may have no internet.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page, re.IGNORECASE)
    assert "@import" not in page and "<link" not in page and "url(" not in page
    assert ".innerHTML" not in page  # prompt text goes in with textContent only


def test_state_needs_the_api_key(server):
    http = server.http()
    assert assert_openai_error(http.get("/dashboard/state"), 401)["code"] == "invalid_api_key"
    wrong = {"Authorization": "Bearer nope"}
    assert_openai_error(http.get("/dashboard/state", headers=wrong), 401)
    assert http.get("/dashboard/state", headers={"x-api-key": API_KEY}).status_code == 200


def test_unknown_query_parameters_are_refused_by_name(server):
    http = server.http(headers=AUTH)
    error = assert_openai_error(http.get("/dashboard/state?top=5"), 400, param="top")
    assert "takes none" in error["message"]
    assert_openai_error(http.get("/dashboard?refresh=1"), 400, param="refresh")
    # A key in the query string would land in access logs: the page takes it after '#'.
    error = assert_openai_error(http.get(f"/dashboard?key={API_KEY}"), 400, param="key")
    assert "/dashboard#key=" in error["message"]


class _FixedDrafter:
    """Drafts the same two tokens every step: some verified, most rejected."""

    def propose(self, request, k: int) -> list[int]:
        return [5, 6][:k]

    def finished(self, request) -> None:
        pass


def test_speculation_shows_the_drafts_metrics_count(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=64, speculative="suffix")
    engine.core.speculator.drafter = _FixedDrafter()
    with running_server(engine) as spec:
        complete(spec, "count the drafts", max_tokens=12)
        s = state(spec)["speculation"]
        assert s["method"] == "suffix" and s["draft_tokens"] > 0
        assert s["draft_tokens"] == spec.metric("pagedserve:spec_decode_num_draft_tokens_total")
        assert s["accepted_tokens"] == spec.metric(
            "pagedserve:spec_decode_num_accepted_tokens_total"
        )


def test_state_shows_a_shared_prefix_and_agrees_with_metrics(server):
    for i in range(3):
        complete(server, f"{SHARED}Question {i}: why?")
    wait_until(server.all_blocks_free, 30, "requests did not finish")
    s = state(server)
    counts = s["blocks"]
    assert counts["in_use"] == 0 and counts["cached"] > 0
    assert sum(counts.values()) == s["num_blocks"] == NUM_BLOCKS
    assert {c: s["block_states"].count(c[0]) for c in ("free", "cached")} == {
        "free": counts["free"],
        "cached": counts["cached"],
    }
    assert block_gauges(server) == {**counts, "total": NUM_BLOCKS}
    # The only blocks cached so far on this server: the shared prefix's and the full blocks
    # each request added to it, one group.
    (top,) = s["prefixes"]
    assert top["requests"] == 0 and top["blocks"] == counts["cached"] >= 3
    assert s["block_states"][top["first_block"]] == "c"
    # The first block's 16 tokens, as text (escaping is the page's: it sets textContent).
    assert top["text"] and SHARED.startswith(top["text"]) and len(top["text"]) <= PREVIEW_CHARS
    assert "<b>Bold</b>" in top["text"]
    assert 0 < s["prefix_cache"]["hits"] < s["prefix_cache"]["queries"]
    assert s["prefix_cache"]["hit_rate"] == s["prefix_cache"]["hits"] / s["prefix_cache"]["queries"]


def test_snapshots_are_shared_between_polls(server):
    """Pollers share one snapshot per interval: the engine thread is not asked per poll."""
    first = state(server)
    calls = []
    real_call = server.client.call

    async def counting_call(fn):
        calls.append(fn)
        return await real_call(fn)

    server.client.call = counting_call
    try:
        started = time.monotonic()
        again = [state(server, fresh=False) for _ in range(5)]
        intervals = (time.monotonic() - started) / SNAPSHOT_INTERVAL_S
        # At most one snapshot per interval the polls spanned, however slow the machine made
        # them (five quick polls: one interval or less, so one snapshot at most).
        assert len(calls) <= int(intervals) + 1, (len(calls), intervals)
        assert len({s["taken_at"] for s in [first, *again]}) == 1 + len(calls)
        time.sleep(SNAPSHOT_INTERVAL_S)
        before = len(calls)
        later = state(server, fresh=False)
    finally:
        del server.client.call
    assert later["taken_at"] > first["taken_at"] and len(calls) == before + 1


def test_metrics_follow_an_abort_and_a_reset_with_no_step_after_them(server):
    http = server.http(headers=AUTH)
    body = {"prompt": "Count: one two", "max_tokens": 900, "ignore_eos": True, "stream": True}
    aborts = server.metric("pagedserve:request_success_total", finished_reason="abort")
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()  # held: a dropped iterator closes the response
        assert next(line for line in lines if line.startswith("data: "))
        assert block_gauges(server)["in_use"] > 0
    # The client left: the engine aborts the request and then has nothing to step.
    wait_until(lambda: block_gauges(server)["in_use"] == 0, 30, "in-use gauge stayed up")
    assert server.metric("pagedserve:request_success_total", finished_reason="abort") == aborts + 1
    assert server.all_blocks_free()
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    gauges = block_gauges(server)
    assert gauges == {"free": NUM_BLOCKS, "cached": 0, "in_use": 0, "total": NUM_BLOCKS}
    assert state(server)["blocks"] == {"free": NUM_BLOCKS, "cached": 0, "in_use": 0}


def test_a_stopped_engine_answers_503_not_500(tiny_model_dir):
    with running_server(make_engine(tiny_model_dir, num_blocks=32)) as stopped:
        stopped.client.begin_shutdown()
        wait_until(lambda: not stopped.client.is_alive, 30, "engine did not stop")
        response = stopped.http().get("/dashboard/state")
        assert assert_openai_error(response, 503)["code"] == "engine_dead"
        assert stopped.http().get("/dashboard").status_code == 200  # the page still loads


def test_an_engine_without_a_local_pool_answers_501(server, monkeypatch):
    async def remote_call(fn):  # what RemoteEngine (data-parallel replicas) answers
        return False

    monkeypatch.setattr(server.client, "call", remote_call)
    time.sleep(SNAPSHOT_INTERVAL_S)
    response = server.http(headers=AUTH).get("/dashboard/state")
    assert assert_openai_error(response, 501)["code"] == "dashboard_unavailable"


def test_openapi_documents_the_state_route_not_the_page(server):
    paths = server.http(headers=AUTH).get("/openapi.json").json()["paths"]
    assert "/dashboard" not in paths
    documented = paths["/dashboard/state"]["get"]["responses"]
    assert {"200", "400", "401", "501", "503"} <= set(documented)


def test_a_hybrid_models_groups_show_on_the_page_and_in_metrics(tmp_path):
    """One full and one sliding-window layer (two KV cache groups): each group's in-use
    blocks, by its attention kind, in the state and in /metrics; all back to 0 after."""
    model = make_tiny_model_dir(tmp_path / "hybrid", use_sliding_window=True, arch="qwen2",
                                sliding_window=32, max_window_layers=1)  # fmt: skip
    with running_server(make_engine(model, num_blocks=64)) as hybrid:
        complete(hybrid, "a fairly long prompt " * 20, max_tokens=8)
        s = state(hybrid)
        assert s["groups"] == [
            {"group": 0, "attention": "full", "in_use": 0},
            {"group": 1, "attention": "sliding_window=32", "in_use": 0},
        ]
        gauges = {k[1]: v for k, v in hybrid.metrics().items()
                  if k[0] == "pagedserve:kv_cache_group_blocks_in_use"}  # fmt: skip
        assert gauges == {
            (("attention", "full"), ("group", "0")): 0,
            (("attention", "sliding_window=32"), ("group", "1")): 0,
        }
        assert s["prefix_cache"]["queries"] > 0 and s["blocks"]["cached"] > 0
