"""Asynchronous Local-SGD on a real local Ray instance, with islands of different speeds."""

from __future__ import annotations

import json

import pytest

from orchestrator.config_load import load_config
from orchestrator.runtime.driver import run

pytestmark = pytest.mark.ray


def _cfg(tmp_path, *extra):
    return load_config(
        None,
        [
            "mode=async",
            "task.factory=tests.toy_tasks:make_quadratic",
            "warm_start.steps=0",
            "task.kwargs.centers=[[1.0,0.0],[-0.5,2.0],[0.5,0.5]]",
            "task.kwargs.batch_s=0.01",
            "islands.count=3",
            "islands.simulated_slowdown=[1,1,4]",
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


def test_async_fixed_h_fast_islands_submit_more_and_staleness_is_recorded(ray_local, tmp_path):
    summary = run(_cfg(tmp_path, "asynchronous.dylu=false"), show_progress=False)
    isl = summary["islands"]
    assert isl["0"]["submissions"] > 2 * isl["2"]["submissions"]
    assert isl["2"]["staleness_max"] >= 2 and summary["staleness"]["max"] >= 2
    assert summary["tokens"] == 3 * 6 * 6  # the same step budget as a synchronous run
    assert summary["outer_steps"] == sum(s["submissions"] for s in isl.values())
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["round"] == 6 and records[-1]["eval_loss"] is not None
    assert all("staleness" in r for r in records)


def test_dylu_gives_the_slow_island_fewer_steps(ray_local, tmp_path):
    summary = run(_cfg(tmp_path, "asynchronous.dylu=true"), show_progress=False)
    isl = summary["islands"]
    mean_h = {i: s["tokens"] / s["submissions"] for i, s in isl.items()}  # one token per step here
    assert mean_h["2"] < mean_h["0"] / 2
    assert isl["2"]["steps_per_s"] < isl["0"]["steps_per_s"] / 2
    assert summary["tokens"] == 3 * 6 * 6


def test_async_survives_a_crashed_island(ray_local, tmp_path):
    summary = run(
        _cfg(
            tmp_path,
            "islands.simulated_slowdown=null",
            "elastic.replace_dead=false",
            "task.kwargs.crash_island=1",
            "task.kwargs.crash_after_batches=8",
        ),
        show_progress=False,
    )
    assert summary["islands"]["1"]["state"] == "dead"
    assert summary["tokens"] == 3 * 6 * 6  # the dead island's unfinished steps were redone by others


@pytest.mark.parametrize("policy", ["reject", "downweight"])
def test_staleness_policy_is_applied_and_counted(ray_local, tmp_path, policy):
    summary = run(
        _cfg(
            tmp_path, "asynchronous.dylu=false", "asynchronous.max_staleness=1", f"asynchronous.stale_policy={policy}"
        ),
        show_progress=False,
    )
    slow = summary["islands"]["2"]
    assert slow["staleness_max"] >= 2
    if policy == "reject":
        assert slow["rejections"] >= 1 and slow["downweighted"] == 0
        # a rejected update's batches went back to the ledger and were trained again
        assert summary["tokens_applied"] == summary["tokens"] == sum(summary["shards"]["tokens"])
    else:
        assert slow["downweighted"] >= 1 and slow["rejections"] == 0
        assert summary["tokens_applied"] == summary["tokens"]


def test_a_virtual_clock_gives_exact_speeds_and_arrivals_in_simulated_order(ray_local, tmp_path):
    """With `islands.virtual_step_s` the islands really train on Ray but nothing sleeps:
    each result counts at its simulated finish (steps x 0.5 s x slowdown), so the speeds
    DyLU sees are exactly 2, 2 and 0.5 steps/s on this contended machine, the slow
    island works a quarter of H, and the run's clock is simulated."""
    summary = run(_cfg(tmp_path, "islands.virtual_step_s=0.5", "inner_steps=8"), show_progress=False)
    isl = summary["islands"]
    assert [isl[i]["steps_per_s"] for i in ("0", "1", "2")] == pytest.approx([2.0, 2.0, 0.5])
    assert [isl[i]["inner_steps"] for i in ("0", "1", "2")] == [8, 8, 2]
    # 6 rounds x 3 islands x 8 steps of budget, at 2 + 2 + 0.5 steps per simulated second
    assert summary["clock_seconds"] == pytest.approx(6 * 3 * 8 / 4.5, rel=0.35)
    assert summary["train_seconds"] < summary["clock_seconds"]  # nothing slept the simulated time
