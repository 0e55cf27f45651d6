"""The ingress's /metrics: every replica's own Prometheus metrics, each sample labelled
with its replica.

Each replica renders its metrics (the single server's, `server/metrics.py`) into its
routing stats about once a second; the ingress merges the latest of each: one HELP and
TYPE per family, then every replica's samples with `replica="<id>"` added.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from server.replicas.prefix_router import replica_stats


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus texts by replica id -> one text, each sample labelled with its replica."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            _, _, lines = families.setdefault(family.name, (family.documentation, family.type, []))
            for sample in family.samples:
                labels = {**sample.labels, "replica": replica}
                rendered = ",".join(f'{k}="{_label(str(v))}"' for k, v in labels.items())
                lines.append(f"{sample.name}{{{rendered}}} {floatToGoString(sample.value)}")
    out = []
    for name, (doc, kind, lines) in families.items():
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n"


class ReplicaMetrics:
    """The `metrics` object the app renders at /metrics, from the replicas' routing stats."""

    def __init__(self, stats: Any = replica_stats) -> None:
        self._stats = stats

    def render(self) -> tuple[bytes, str]:
        texts = {rid: s["metrics"] for rid, s in self._stats().items() if "metrics" in s}
        return merge_metrics(texts).encode(), CONTENT_TYPE_LATEST

    def num_waiting(self) -> int:
        return sum(int(s.get("num_waiting", 0)) for s in self._stats().values())
