"""Each run its own folder: with default settings two runs leave both runs' records
intact, `runs/latest` points at the newer, and `--resume runs/latest` finds it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from archipelago.orchestrator.config_load import ConfigError, check_folders, load_config
from archipelago.orchestrator.engine.state.logfiles import read_lines
from archipelago.orchestrator.engine.state.records import link_latest
from tests.helpers import TINY_LM


def test_out_dir_takes_the_run_id_and_nothing_else_in_braces(tmp_path):
    cfg = load_config(None, [])
    assert cfg.out_dir == "runs/{run_id}" and cfg.for_run("a1").out_dir == "runs/a1"
    assert cfg.for_run("a1").checkpoint_dir == "runs/a1/checkpoint"
    fixed = load_config(None, [f"out_dir={tmp_path / 'mine'}"])
    assert fixed.for_run("a1") is fixed  # a fixed folder is used as given
    with pytest.raises(ConfigError, match="out_dir"):
        load_config(None, ["out_dir=runs/{seed}"])
    check_folders(load_config(None, [f"out_dir={tmp_path / 'runs' / '{run_id}'}"]))  # the folder above is probed
    assert (tmp_path / "runs").is_dir() and not list((tmp_path / "runs").iterdir())


def test_latest_follows_the_newest_run_and_never_replaces_a_real_folder(tmp_path):
    runs = tmp_path / "runs"
    for run in ("a", "b"):
        (runs / run).mkdir(parents=True)
        link_latest(f"{runs}/{{run_id}}", run)
        assert os.readlink(runs / "latest") == run and (runs / "latest").resolve() == (runs / run).resolve()
    assert sorted(p.name for p in runs.iterdir()) == ["a", "b", "latest"]  # no temporary link left
    old = tmp_path / "old"
    (old / "latest").mkdir(parents=True)
    link_latest(f"{old}/{{run_id}}", "c")
    assert (old / "latest").is_dir() and not (old / "latest").is_symlink()
    link_latest(f"{tmp_path}/fixed", "d")  # no placeholder: nothing to point at
    assert not (tmp_path / "latest").exists()


@pytest.mark.ray
def test_two_runs_with_default_settings_keep_both_runs_records(ray_local, tmp_path, monkeypatch, corpus_cache):
    from archipelago.orchestrator.runtime.driver import resume_id, run

    monkeypatch.chdir(tmp_path)
    sets = [*TINY_LM, f"task.kwargs.cache_dir={corpus_cache}", "rounds=2", "inner_steps=3", "islands.count=2"]
    cfg = load_config(None, sets)
    assert cfg.out_dir == "runs/{run_id}"  # the default
    ids = []
    for _ in range(2):
        summary = run(cfg, show_progress=False)
        ids.append(os.readlink(tmp_path / "runs" / "latest"))
        assert Path(summary["out_dir"]).resolve() == (tmp_path / "runs" / ids[-1]).resolve()
    assert ids[0] != ids[1]
    for run_id in ids:
        folder = Path("runs") / run_id
        assert (folder / "run_id").read_text().strip() == run_id
        records = [json.loads(line) for line in read_lines(folder / "metrics.jsonl")]
        assert [r["round"] for r in records] == [1, 2]
        assert json.loads((folder / "summary.json").read_text())["outer_steps"] == 2
        assert list((folder / "checkpoint").iterdir()) == [folder / "checkpoint" / run_id]
    # `--resume runs/latest` (the command puts it in out_dir) continues the newer run
    assert resume_id(load_config(None, [*sets, "out_dir=runs/latest"])) == ids[1]
