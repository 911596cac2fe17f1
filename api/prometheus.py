"""The run's metrics for Prometheus, exposed with `prometheus_client` from the handle's
status and islands (so `/metrics` works without Ray's metrics agent): counters as counters,
round time and update staleness as histograms, and series labelled `run_id` and `island`
only. An island's state is a state set (`archipelago_island_state`, one series per state,
1 for the current one), never a label of its other series, so no series changes a label
while it lives. Islands that left the run (drained, dead, quarantined) have no series."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest

from archipelago.orchestrator import build_info
from archipelago.orchestrator.engine.fleet.watch import watched
from archipelago.orchestrator.engine.state import views
from archipelago.orchestrator.engine.state.views import (
    HISTOGRAMS,
    ISLAND_METRICS,
    ISLAND_STATE,
    RUN_METRICS,
    MetricKind,
    current,
)
from archipelago.orchestrator.engine.types import IslandState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BUILD_INFO = "archipelago_build_info"  # 1, labelled with the version and commit (Prometheus' `_info` idiom)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _family(metric: views.Metric, labels: list[str]) -> GaugeMetricFamily | CounterMetricFamily:
    kind = CounterMetricFamily if metric.kind == MetricKind.COUNTER else GaugeMetricFamily
    return kind(metric.name, metric.help, labels=labels)


class RunCollector:
    """One scrape's families, built from one status and islands view (a snapshot: the
    engine keeps the values, nothing is accumulated here)."""

    def __init__(self, status: dict[str, Any], islands: dict[str, dict[str, Any]]) -> None:
        now = time.time()
        self.status, self.islands = status, {i: watched(s, now) for i, s in current(islands).items()}
        self.run = str(status.get("run_id", ""))

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            BUILD_INFO, "The version and the commit of the code serving these metrics", labels=["version", "commit"]
        )
        info.add_metric([build_info.version(), build_info.commit()], 1.0)
        yield info
        for metric in RUN_METRICS:
            family = _family(metric, ["run_id"])
            value = _number(self.status.get(metric.key))
            if value is not None:
                family.add_metric([self.run], value)
            yield family
        for metric in HISTOGRAMS:
            buckets = HistogramMetricFamily(metric.name, metric.help, labels=["run_id"])
            histogram = self.status.get("histograms", {}).get(metric.key)
            if histogram is not None:
                bounds = [repr(float(b)) for b in histogram["bounds"]] + ["+Inf"]
                counts = list(itertools.accumulate(histogram["counts"]))
                buckets.add_metric([self.run], list(zip(bounds, counts)), histogram["sum"])
            yield buckets
        islands = sorted(self.islands.items(), key=lambda kv: int(kv[0]))
        for metric in ISLAND_METRICS:
            family = _family(metric, ["run_id", "island"])
            for island, stats in islands:
                value = _number(stats.get(metric.key))
                if value is not None:
                    family.add_metric([self.run, island], value)
            yield family
        states = GaugeMetricFamily(ISLAND_STATE.name, ISLAND_STATE.help, labels=["run_id", "island", "state"])
        for island, stats in islands:
            for state in IslandState:
                states.add_metric([self.run, island, state.value], float(stats.get("state") == state.value))
        yield states


def render(status: dict[str, Any], islands: dict[str, dict[str, Any]]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(status, islands))
    return generate_latest(registry)
