"""The run's metrics through `ray.util.metrics`, so they reach Ray's Prometheus pipeline
(exported with a `ray_` prefix by every node's metrics agent, port 8080 on KubeRay) and
the Grafana dashboard in `k8s/`. Same names, kinds and meaning as the control plane's
`/metrics` (`engine/state/views.py`): counters are Ray counters, fed the growth since the last
record; histograms observe each record's round time and update staleness; an island's
state is a state set, not a label of its series."""

from __future__ import annotations

import time
from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

from ..engine.fleet.watch import watched
from ..engine.state.distributions import ROUND_SECONDS, STALENESS
from ..engine.state.views import (
    HISTOGRAMS,
    ISLAND_METRICS,
    ISLAND_STATE,
    RUN_METRICS,
    Metric,
    MetricKind,
    RoundRecord,
    RunStatus,
    current,
)
from ..engine.types import IslandState


def _instrument(metric: Metric, tags: tuple[str, ...]) -> Gauge | Counter:
    kind = Counter if metric.kind == MetricKind.COUNTER else Gauge
    return kind(metric.name, metric.help, tag_keys=tags)


class RayMetrics:
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.run = {m.key: (m, _instrument(m, ("run_id",))) for m in RUN_METRICS}
        self.island = {m.key: (m, _instrument(m, ("run_id", "island"))) for m in ISLAND_METRICS}
        round_time, staleness = HISTOGRAMS
        self.round_time = Histogram(round_time.name, round_time.help, list(ROUND_SECONDS), tag_keys=("run_id",))
        self.staleness = Histogram(staleness.name, staleness.help, list(STALENESS), tag_keys=("run_id",))
        self.state = Gauge(ISLAND_STATE.name, ISLAND_STATE.help, tag_keys=("run_id", "island", "state"))
        self._counted: dict[tuple[str, str | None], float] = {}  # what each counter was fed so far

    def _set(self, metric: Metric, instrument: Gauge | Counter, value: Any, island: str | None) -> None:
        if not isinstance(value, (int, float)):
            return
        tags = {"run_id": self.run_id} if island is None else {"run_id": self.run_id, "island": island}
        if isinstance(instrument, Counter):
            seen = self._counted.get((metric.key, island), 0.0)
            if value < seen:  # counted afresh (the main phase's rounds after a warm start's): from 0
                seen = self._counted[(metric.key, island)] = 0.0
            if value > seen:
                instrument.inc(float(value) - seen, tags=tags)
                self._counted[(metric.key, island)] = float(value)
        else:
            instrument.set(float(value), tags=tags)

    def publish(self, status: RunStatus, islands: dict[str, dict[str, Any]], record: RoundRecord) -> None:
        tags = {"run_id": self.run_id}
        for metric, instrument in self.run.values():
            self._set(metric, instrument, getattr(status, metric.key), None)
        if record.round_seconds is not None:
            self.round_time.observe(record.round_seconds, tags=tags)
        for staleness in record.staleness_updates:
            self.staleness.observe(staleness, tags=tags)
        now = time.time()
        for island, view in current(islands).items():  # a gone island's series are no longer
            # re-reported, and Ray's metrics agent ages them out
            stats = watched(view, now)
            for metric, instrument in self.island.values():
                self._set(metric, instrument, stats.get(metric.key), island)
            for state in IslandState:
                self.state.set(
                    float(stats["state"] == state.value), tags={**tags, "island": island, "state": state.value}
                )
