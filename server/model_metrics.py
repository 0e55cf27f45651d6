"""/metrics of a server of several models: the router's own series (models loaded, loads,
unloads, load failures and load time, by model) and every loaded model's engine series
with a `model` label added.

Each model's engine keeps its own `ServerMetrics` registry (server/metrics.py), as a
single-model server does; a scrape merges them family by family, so one series name holds
every model's values (`pagedserve:generation_tokens_total{model="a"}`). A model's engine
series go when it unloads: its counters start from zero when it loads again (Prometheus's
`rate()` reads that as a counter reset).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.metrics import PREFIX
from server.model_registry import ModelEntry, ModelState

Models = Callable[[], list[ModelEntry]]  # every model, as the router holds them now

LOAD_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)


class ModelMetrics:
    def __init__(self, models: Models) -> None:
        self.registry = r = CollectorRegistry()
        self.loads = Counter(PREFIX + "model_loads", "Models loaded, by model.", ["model"],
                             registry=r)  # fmt: skip
        self.unloads = Counter(PREFIX + "model_unloads", "Models unloaded (drained, then "
                               "stopped), by model.", ["model"], registry=r)  # fmt: skip
        self.load_failures = Counter(PREFIX + "model_load_failures", "Model loads that "
                                     "failed, by model.", ["model"], registry=r)  # fmt: skip
        self.load_seconds = Histogram(
            PREFIX + "model_load_seconds", "Seconds a model took to load, by model.", ["model"],
            buckets=LOAD_SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        r.register(_ModelStates(models))
        r.register(_EngineSeries(models))

    def on_loaded(self, model: str, seconds: float) -> None:
        self.loads.labels(model).inc()
        self.load_seconds.labels(model).observe(seconds)

    def on_unloaded(self, model: str) -> None:
        self.unloads.labels(model).inc()

    def on_load_failed(self, model: str) -> None:
        self.load_failures.labels(model).inc()

    def on_grammar(self, cache_hit: bool, seconds: float) -> None:
        """Unused here: each model's engine counts its own grammars."""

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _ModelStates(Collector):
    """`models_loaded` and `model_state{model,state}` (1 for the model's state), read from
    the router when scraped."""

    def __init__(self, models: Models) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        entries = self._models()
        loaded = GaugeMetricFamily(PREFIX + "models_loaded", "Models loaded now.")
        loaded.add_metric([], sum(1 for e in entries if e.state is ModelState.LOADED))
        states = GaugeMetricFamily(
            PREFIX + "model_state", "Each model's state (1): unloaded, loading, loaded, "
            "unloading or failed.", labels=["model", "state"],
        )  # fmt: skip
        for e in entries:
            states.add_metric([e.name, e.state.value], 1)
        yield loaded
        yield states


class _EngineSeries(Collector):
    """Every engine's series, merged by family, each sample labelled with its model."""

    def __init__(self, models: Models) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for entry in self._models():
            if entry.client is None:
                continue
            registry = getattr(entry.client.metrics, "registry", None)
            if registry is None:
                continue
            for family in registry.collect():
                out = merged.get(family.name)
                if out is None:
                    out = Metric(family.name, family.documentation, family.type, family.unit)
                    merged[family.name] = out
                out.samples.extend(s._replace(labels={**s.labels, "model": entry.name})
                                   for s in family.samples)  # fmt: skip
        yield from merged.values()
