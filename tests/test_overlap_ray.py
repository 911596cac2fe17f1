"""CO2 overlap over a simulated link, its islands real actors on a local Ray instance, on
the virtual clock and on the real one (`archipelago.orchestrator.bench.simulation.ray_pool`)."""

from __future__ import annotations

import json

import pytest

from archipelago.orchestrator.bench.simulation.config import load_simulated
from archipelago.orchestrator.bench.simulation.ray_pool import run_simulated
from archipelago.orchestrator.config_load import ConfigError
from tests.helpers import toy_quadratic

pytestmark = pytest.mark.ray

# 2 parameters of float64 = 16 bytes: a 0.2 s latency dominates every transfer
BASE = toy_quadratic(
    2,
    0.0,
    "rounds=5",
    "inner_steps=10",
    "simulation.virtual_step_s=0.05",
    "simulation.link.latency_ms=200",
    "simulation.link.bandwidth_gbps=100",
)


def _run(tmp_path, name, *extra):
    cfg, sim = load_simulated(None, [*BASE, f"out_dir={tmp_path / name}", *extra])
    return run_simulated(cfg, sim, show_progress=False)


def test_overlap_hides_the_link_that_sync_waits_for(ray_local, tmp_path):
    sync = _run(tmp_path, "sync", "mode=diloco", "rounds=6")
    overlap = _run(tmp_path, "overlap", "mode=overlap", "rounds=6")
    # A round is 0.5 s of compute and a 0.4 s round trip (Δ up, θ down). Sync pays both every
    # round; overlap's first two rounds do too (round 2 starts from θ₁, by design), then each
    # round trip hides behind the next round's compute: 4 × 0.4 = 1.6 s saved, on the
    # virtual clock exactly (each transfer one 0.2-s latency: 16 bytes at 100 Gbit/s).
    assert sync["clock_seconds"] == pytest.approx(6 * (0.5 + 0.4), abs=0.05)
    assert overlap["clock_seconds"] == pytest.approx(sync["clock_seconds"] - 1.6, abs=0.05)
    assert overlap["tokens"] == sync["tokens"] == 2 * 6 * 10
    assert overlap["outer_steps"] == 6
    records = [json.loads(line) for line in (tmp_path / "overlap" / "metrics.jsonl").read_text().splitlines()]
    assert [r["staleness"] for r in records] == [0, 0, 1, 1, 1, 1]
    assert all(not r["rejected"] for r in records)


@pytest.mark.quiet  # a wall-clock comparison: beside no other test (tests/ray_apart.py)
def test_on_the_real_clock_the_wall_holds_the_link_and_overlap_hides_it(ray_local, tmp_path):
    """`simulation.clock: real`: the same fleet with its link waited for in real time, so a
    run's wall (what `bench overlap` and `bench streaming` compare) holds it. On the
    virtual clock a real wall held no link at all (sync's 0.98x compute-only in `bench
    overlap`), which made their wall checks true by construction."""
    real = ["simulation.clock=real", "simulation.virtual_step_s=1.0"]
    with pytest.raises(ConfigError, match=r"virtual_step_s: a simulated pace needs clock virtual"):
        load_simulated(None, [*BASE, *real])
    # the same fleet, its compute real: 10 batches of 0.05 s a round
    base = toy_quadratic(
        2, 0.05, "rounds=6", "inner_steps=10", "simulation.link.latency_ms=200", "simulation.link.bandwidth_gbps=100"
    )
    runs = {}
    for mode in ("diloco", "overlap"):
        cfg, sim = load_simulated(None, [*base, "simulation.clock=real", f"mode={mode}", f"out_dir={tmp_path / mode}"])
        runs[mode] = run_simulated(cfg, sim, show_progress=False)
    sync, overlap = runs["diloco"], runs["overlap"]
    # sync waits for six round trips of 0.4 s after 0.5 s of compute each; overlap for the
    # first two only (4 x 0.4 = 1.6 s hidden behind compute), give or take Ray's own latency
    assert sync["train_seconds"] >= 6 * (0.5 + 0.4)
    assert overlap["train_seconds"] <= sync["train_seconds"] - 1.0
    assert overlap["tokens"] == sync["tokens"] == 2 * 6 * 10 and overlap["outer_steps"] == 6
