"""deploy/grafana-dashboard.json: valid, on a Prometheus datasource variable, and every
expression asks only for series a live server really exports (names and fixed labels)."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import RunningServer

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

METRIC = re.compile(r"pagedserve:[A-Za-z0-9_:]+")
SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}")
FIXED_MATCHER = re.compile(r'(\w+)="([^"$]*)"')  # label="value", not a $variable's =~
GROUPED = re.compile(r"by \(([^)]*)\) \(\s*(?:rate\()?(pagedserve:[A-Za-z0-9_:]+)")


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exported(server: RunningServer) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets it has on a live server that served a request."""
    body = {"prompt": "hello there", "max_tokens": 3}
    assert server.http().post("/v1/completions", json=body).status_code == 200
    series: dict[str, list[dict[str, str]]] = defaultdict(list)
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series[sample.name].append(dict(sample.labels))
    return series


def expressions(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_it_reads_a_prometheus_datasource_variable(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["datasource"] == DATASOURCE
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["refId"]


def test_expressions_are_balanced_and_filter_by_instance(dashboard):
    for expr in expressions(dashboard):
        for opening, closing in ("()", "{}", "[]"):
            depth = 0
            for char in expr:
                depth += (char == opening) - (char == closing)
                assert depth >= 0, expr
            assert depth == 0, expr
        for _, matchers in SELECTOR.findall(expr):  # every selector, so $instance applies
            assert 'instance=~"$instance"' in matchers, expr


def test_every_series_asked_for_is_exported(dashboard, exported):
    for expr in expressions(dashboard):
        # Anything selected is one of ours (no other exporter's or a misspelt metric) ...
        for name, matchers in SELECTOR.findall(expr):
            assert name.startswith("pagedserve:"), expr
            # ... and exported, with the labels its fixed matchers name.
            assert name in exported, f"{name} is not in /metrics"
            wanted = dict(FIXED_MATCHER.findall(matchers))
            assert any(wanted.items() <= labels.items() for labels in exported[name]), expr
        for name in METRIC.findall(expr):
            assert name in exported, f"{name} is not in /metrics"
        for labels, name in GROUPED.findall(expr):
            for label in (part.strip() for part in labels.split(",")):
                assert any(label in s for s in exported[name]), f"{name} has no label {label}"


def test_it_shows_what_the_cache_needs_watching(dashboard):
    exprs = expressions(dashboard)
    joined = "\n".join(exprs)
    hit_rate = [e for e in exprs if "prefix_cache_hits_total" in e and "/" in e]
    assert hit_rate and all(
        e.index("prefix_cache_hits_total") < e.index("/") < e.index("prefix_cache_queries_total")
        for e in hit_rate
    )
    for metric in (
        "kv_cache_usage_perc", "kv_cache_blocks", "num_requests_running",
        "num_requests_waiting", "num_preemptions_total", "prompt_tokens_total",
        "generation_tokens_total",
    ):  # fmt: skip
        assert f"pagedserve:{metric}" in joined, metric
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds"):
        for q in ("0.5", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(pagedserve:{histogram}_bucket" in (
                joined
            ), (histogram, q)
