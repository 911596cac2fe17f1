"""Asynchronous Local-SGD on a real local Ray instance: the Ray pool's virtual clock. What
the engine decides in async mode (staleness, DyLU's step counts, the stale policies, a
crashed island in every mode) is checked on the in-process pool (test_runs_in_process.py,
test_engine*.py); an island's actor dying on Ray, in test_run_ray.py and test_chaos_ray.py."""

from __future__ import annotations

import pytest

from archipelago.orchestrator.bench.simulation.config import load_simulated
from archipelago.orchestrator.bench.simulation.ray_pool import run_simulated

pytestmark = pytest.mark.ray


def _cfg(tmp_path, *extra):
    return load_simulated(
        None,
        [
            "mode=async",
            "mode.rule=delayed_nesterov",
            "task.factory=tests.toy_tasks:make_quadratic",
            "warm_start.steps=0",
            "task.kwargs.centers=[[1.0,0.0],[-0.5,2.0],[0.5,0.5]]",
            "task.kwargs.batch_s=0.01",
            "islands.count=3",
            "simulation.slowdown=[1,1,4]",
            "inner.optimizer=sgd",
            "inner.lr=0.1",
            "inner.warmup_steps=0",
            "rounds=6",
            "inner_steps=6",
            "data_shards=3",
            f"task.kwargs.fault_dir={tmp_path}",
            f"out_dir={tmp_path / 'out'}",
            *extra,
        ],
    )


def test_a_virtual_clock_gives_exact_speeds_and_arrivals_in_simulated_order(ray_local, tmp_path):
    """With `simulation.virtual_step_s` the islands really train on Ray but nothing sleeps:
    each result counts at its simulated finish (steps x 0.5 s x slowdown), so the speeds
    DyLU sees are exactly 2, 2 and 0.5 steps/s on this contended machine, the slow
    island works a quarter of H, and the run's clock is simulated; heartbeats count the
    simulated steps, so none is taken for a hang."""
    beats = ("elastic.hang_after_steps=2", "elastic.progress_every_s=0.2", "elastic.hang_floor_s=0.5")
    cfg, sim = _cfg(tmp_path, "simulation.virtual_step_s=0.5", "inner_steps=8", *beats)
    summary = run_simulated(cfg, sim, show_progress=False)
    isl = summary["islands"]
    # heartbeats on the simulated clock: a jump of the clock to the next finish is no stall
    assert all(isl[i]["state"] == "training" for i in ("0", "1", "2")), isl
    assert [isl[i]["steps_per_s"] for i in ("0", "1", "2")] == pytest.approx([2.0, 2.0, 0.5])
    assert [isl[i]["inner_steps"] for i in ("0", "1", "2")] == [8, 8, 2]
    # 6 rounds x 3 islands x 8 steps of budget, at 2 + 2 + 0.5 steps per simulated second
    assert summary["clock_seconds"] == pytest.approx(6 * 3 * 8 / 4.5, rel=0.35)
    assert summary["train_seconds"] < summary["clock_seconds"]  # nothing slept the simulated time
