"""The run's metrics through `ray.util.metrics`, so they reach Ray's Prometheus pipeline
(exported with a `ray_` prefix by every node's metrics agent, port 8080 on KubeRay) and
the Grafana dashboard in `k8s/`. Same names and meaning as the control plane's `/metrics`."""

from __future__ import annotations

from typing import Any

from ray.util.metrics import Gauge

from orchestrator.engine.views import ISLAND_METRICS, RUN_METRICS, current


class RayMetrics:
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.run = {key: Gauge(name, help_text, tag_keys=("run_id",)) for name, key, help_text, _ in RUN_METRICS}
        self.island = {
            key: Gauge(name, help_text, tag_keys=("run_id", "island")) for name, key, help_text, _ in ISLAND_METRICS
        }

    def publish(self, status: dict[str, Any], islands: dict[str, dict[str, Any]]) -> None:
        for key, gauge in self.run.items():
            if isinstance(status.get(key), (int, float)):
                gauge.set(float(status[key]), tags={"run_id": self.run_id})
        for island, stats in current(islands).items():  # a gone island's gauges are no longer
            # re-reported, and Ray's metrics agent ages them out
            for key, gauge in self.island.items():
                if isinstance(stats.get(key), (int, float)):
                    gauge.set(float(stats[key]), tags={"run_id": self.run_id, "island": island})
