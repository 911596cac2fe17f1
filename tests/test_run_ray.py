"""End-to-end runs on a real local Ray instance (islands and coordinator as actors). The
engine's own decisions in whole runs are checked in process (test_runs_in_process.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.runtime.driver import run
from archipelago.workers.tasks.lm_task import make_task
from tests.helpers import events, tiny_lm_config, toy_quadratic

pytestmark = pytest.mark.ray


def _lm_cfg(tmp_path, corpus_cache, *extra):
    return tiny_lm_config(tmp_path / "out", corpus_cache, *extra)


def test_diloco_three_islands_learns_and_writes_outputs(ray_local, tmp_path, corpus_cache):
    cfg = _lm_cfg(tmp_path, corpus_cache, "islands.count=3", "rounds=4", "inner_steps=15")
    summary = run(cfg, show_progress=False)
    out = tmp_path / "out"
    for key in (
        "initial_eval_loss",
        "final_eval_loss",
        "tokens",
        "outer_steps",
        "bytes_communicated",
        "wall_seconds",
        "islands",
    ):
        assert key in summary
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5
    assert summary["outer_steps"] == 4 and summary["tokens"] == 3 * 4 * 15 * 8 * 32
    assert set(summary["islands"]) == {"0", "1", "2"}
    assert all(s["rounds_contributed"] == 4 for s in summary["islands"].values())
    assert json.loads((out / "summary.json").read_text())["final_eval_loss"] == summary["final_eval_loss"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2, 3, 4]
    assert {
        "version",
        "island_train_loss",
        "eval_loss",
        "tokens",
        "bytes_sent",
        "bytes_received",
        "round_seconds",
    } <= set(records[0])
    model = make_task(**cfg.task.kwargs).build_model()
    model.load_state_dict(torch.load(out / "final.pt"))
    assert (out / "config.yaml").exists()


def test_a_warm_started_run_forks_on_ray_and_continues_the_warm_starts_data(ray_local, tmp_path, corpus_cache):
    """The coordinator actor trains the warm start (the default: Local SGD over the run's
    islands, here one round of 8 steps), then the islands fork from it, each renewed in
    its own process: no batch of the warm start is read again, progress says which phase
    it is in, and the islands are gone from Ray when the run ends."""
    from archipelago.orchestrator.runtime.island_actors import run_islands

    cfg = _lm_cfg(tmp_path, corpus_cache, "islands.count=2", "rounds=2", "inner_steps=4", "warm_start.steps=8")
    called = time.time()
    summary = run(cfg, show_progress=False, started_at=called)
    # start-up, measured where it happens: the run's first step is the warm start's, and its
    # parts (Ray, the coordinator, the islands, the first eval) come before it in that order
    startup = summary["startup"]
    first = startup["first_inner_step_at"]
    assert startup["engine_created_at"] < first < startup["first_outer_step_at"] < time.time()
    assert summary["startup_seconds"] == pytest.approx(first - called)
    assert 0 < startup["command"]["ray_s"] + startup["command"]["coordinator_s"] < summary["startup_seconds"]
    assert 0 < startup["islands_joined_s"] <= startup["engine_to_first_step_s"]
    assert startup["island_task_s"] > 0 and startup["island_model_s"] > 0
    assert "island_probe_s" not in startup  # equal H for every island: the first round measures the speed
    assert startup["first_eval_s"] > 0 and startup["dispatch_to_first_step_s"] > 0
    fork = startup["fork"]  # the main phase took the warm start's islands over, in their processes
    assert fork["engine_created_at"] > startup["first_outer_step_at"] and fork["islands_joined_s"] > 0
    # both phases' islands were adopted: the command started them beside the coordinator,
    # and the main phase took the warm start's over
    for folder in (Path(cfg.out_dir) / "warm_start", cfg.out_dir):
        joins = [e for e in events(folder) if e["kind"] == "join"]
        assert sorted(e["island"] for e in joins if e.get("adopted")) == [0, 1], folder
    assert json.loads((Path(cfg.out_dir) / "summary.json").read_text())["startup_seconds"] == summary["startup_seconds"]
    warm = summary["warm_start"]
    assert warm["steps"] == 8 and warm["mode"] == "average" and warm["tokens"] == 2 * 8 * 8 * 32
    assert summary["initial_eval_loss"] == pytest.approx(warm["final_eval_loss"], rel=1e-6)
    assert summary["tokens"] == 2 * 2 * 4 * 8 * 32
    # 8 shards, each read (8 + 8) x 2 / 8 = 4 batches: the fork's reads follow the warm start's
    assert summary["shards"]["position"] == [4] * 8
    assert not run_islands(warm["run_id"]) and not run_islands(warm["run_id"][: -len("-warm")])


def _quadratic(tmp_path, *extra):
    sets = toy_quadratic(3, 0.0, "data_shards=3", f"task.kwargs.fault_dir={tmp_path}", f"out_dir={tmp_path / 'out'}")
    return load_config(None, [*sets, *extra])


def test_a_crashed_island_does_not_stop_the_run(ray_local, tmp_path):
    cfg = _quadratic(
        tmp_path,
        "rounds=4",
        "inner_steps=3",
        "elastic.replace_dead=false",
        "data_shards=3",
        "task.kwargs.crash_island=1",
        "task.kwargs.crash_after_batches=4",
    )
    summary = run(cfg, show_progress=False)
    islands = summary["islands"]
    assert islands["1"]["state"] == "dead" and "died" in islands["1"]["error"]
    assert islands["1"]["rounds_contributed"] == 1
    assert islands["0"]["rounds_contributed"] == islands["2"]["rounds_contributed"] == 4
    assert summary["outer_steps"] == 4
    # the dead island's shard moved to a survivor and continued where it stood: nothing lost or repeated
    shards = summary["shards"]
    assert sum(shards["tokens"]) == summary["tokens"] == 3 * 3 + 3 * 2 * 3  # round 1 full, then 2 islands
    assert shards["position"][1] > 3 and sum(shards["position"]) == summary["tokens"]


def test_a_stalled_island_is_left_behind_by_the_round_deadline(ray_local, tmp_path):
    cfg = _quadratic(
        tmp_path,
        "rounds=3",
        "inner_steps=2",
        "round_timeout_s=1.0",
        "step_timeout_s=0",
        "elastic.replace_dead=false",
        "task.kwargs.stall_island=2",
        "task.kwargs.stall_s=120",
    )
    t0 = time.perf_counter()
    summary = run(cfg, show_progress=False)
    assert time.perf_counter() - t0 < 100  # never the stall's 120 s, however loaded the machine
    assert summary["islands"]["2"]["late_results"] >= 1
    assert summary["islands"]["0"]["rounds_contributed"] == 3


def test_the_first_run_forking_from_a_warm_start_builds_version_0_on_every_island(ray_local, tmp_path):
    """With `islands.build_version0`, the first run to fork from a finished warm start
    writes the file its islands load version 0 from (its coordinator does): the command
    starts no island before that file is there, so none finds it missing and downloads
    the model instead."""
    first = _quadratic(tmp_path, "rounds=1", "inner_steps=2", "warm_start.steps=4")
    run(first, show_progress=False)
    warm = Path(first.out_dir) / "warm_start"
    assert not (warm / "version0.npy").exists()
    cfg = _quadratic(
        tmp_path,
        "rounds=1",
        "inner_steps=2",
        "warm_start.steps=4",
        f"warm_start.path={warm}",
        "islands.build_version0=true",
        f"out_dir={tmp_path / 'fork'}",
    )
    summary = run(cfg, show_progress=False)
    assert summary["bytes_bootstrap"] == 0
    joins = [e for e in events(Path(cfg.out_dir)) if e["kind"] == "join"]
    assert [e["version0"] for e in joins] == ["built"] * 3
