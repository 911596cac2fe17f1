"""CO2 overlap and link simulation on a real local Ray instance."""

from __future__ import annotations

import json

import pytest

from orchestrator.config_load import load_config
from orchestrator.runtime.driver import run
from tests.helpers import toy_quadratic

pytestmark = pytest.mark.ray

# 2 parameters of float64 = 16 bytes: a 0.2 s latency dominates every transfer
BASE = toy_quadratic(
    2, 0.05, "rounds=5", "inner_steps=10", "simulation.link.latency_ms=200", "simulation.link.bandwidth_gbps=100"
)


def _run(tmp_path, name, *extra):
    cfg = load_config(None, [*BASE, f"out_dir={tmp_path / name}", *extra])
    return run(cfg, show_progress=False)


def test_overlap_hides_the_link_that_sync_waits_for(ray_local, tmp_path):
    sync = _run(tmp_path, "sync", "mode=diloco", "rounds=6")
    overlap = _run(tmp_path, "overlap", "mode=overlap", "rounds=6")
    # A round is 0.5 s of compute and a 0.4 s round trip (Δ up, θ down). Sync pays both every
    # round; overlap's first two rounds do too (round 2 starts from θ₁, by design), then each
    # round trip hides behind the next round's compute: 4 × 0.4 = 1.6 s saved in theory.
    assert sync["train_seconds"] > overlap["train_seconds"] + 1.0
    assert overlap["idle_fraction"] < sync["idle_fraction"]
    assert overlap["tokens"] == sync["tokens"] == 2 * 6 * 10
    assert overlap["outer_steps"] == 6
    records = [json.loads(line) for line in (tmp_path / "overlap" / "metrics.jsonl").read_text().splitlines()]
    assert [r["staleness"] for r in records] == [0, 0, 1, 1, 1, 1]
    assert all(not r["rejected"] for r in records)
