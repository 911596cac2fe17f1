"""Run metrics reach Ray's Prometheus pipeline (`ray.util.metrics`, scraped from the node's
metrics export port, as Prometheus does on a cluster), and the coordinator feeds the
experiment trackers."""

from __future__ import annotations

import time

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.runtime.driver import run
from tests.conftest import importable_checkout
from tests.helpers import toy_quadratic
from tests.http_server import free_port

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def metrics_port():
    ray.shutdown()
    port = free_port()
    with importable_checkout():
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            _metrics_export_port=port,
            _system_config={"metrics_report_interval_ms": 500},
        )
    yield port
    ray.shutdown()


def test_island_staleness_is_exported_with_the_ray_prefix(metrics_port, tmp_path):
    cfg = load_config(
        None,
        toy_quadratic(
            2,
            0.05,
            "islands.cpus=0.5",
            "inner_steps=4",
            "rounds=30",
            f"out_dir={tmp_path / 'out'}",
            "tracking.backends=[tensorboard]",
        ),
    )
    run(cfg, show_progress=False, run_id="metricstest")
    # the coordinator feeds the trackers too (read back: tests/test_tracking.py)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tmp_path / "out" / "tracking" / "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()
    assert [e.step for e in board.Scalars("eval_loss")] == list(range(1, 31))
    deadline, text = time.time() + 30, ""
    wanted = ("ray_archipelago_island_staleness_versions{", "ray_archipelago_round_duration_seconds_bucket{")
    while time.time() < deadline and not all(w in text for w in wanted):
        time.sleep(0.5)
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    lines = [line for line in text.splitlines() if line.startswith("ray_archipelago_island_staleness_versions{")]
    assert any('island="1"' in line and 'run_id="metricstest"' in line for line in lines), text[-2000:]
    families = {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("ray_archipelago")}
    assert families["ray_archipelago_tokens"].type == "counter"  # counters as counters, named _total
    assert families["ray_archipelago_island_tokens"].type == "counter"
    rounds = families["ray_archipelago_round_duration_seconds"]
    assert rounds.type == "histogram"
    assert max(s.value for s in rounds.samples if s.name.endswith("_count")) == 30
    states = [s for s in families["ray_archipelago_island_state"].samples if s.labels["run_id"] == "metricstest"]
    assert {s.labels["state"] for s in states if s.value == 1} == {"training"}
    assert "ray_archipelago_eval_loss" in families
