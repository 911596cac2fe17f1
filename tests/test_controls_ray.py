"""Operator controls on a running job: settings at round boundaries, pause/resume, stop."""

from __future__ import annotations

import json
import threading
import time

import pytest
import ray
from pydantic import ValidationError

from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.commands import Ack, Pause, Resume, SettingsUpdate, Stop, UpdateSettings
from archipelago.orchestrator.runtime.driver import run
from archipelago.orchestrator.runtime.names import NAMESPACE
from tests.helpers import toy_quadratic

pytestmark = pytest.mark.ray


def _lines(path):
    return path.read_text().splitlines() if path.exists() else []


def test_settings_pause_resume_and_stop(ray_local, tmp_path):
    """Commands sent to the coordinator actor through Ray; the engine's handling of them in
    every mode is checked in process (test_engine.py, test_phases.py)."""
    cfg = load_config(
        None,
        toy_quadratic(
            2,
            0.03,
            "inner_steps=4",
            "rounds=200",
            "checkpoint.every_rounds=10",
            f"out_dir={tmp_path / 'out'}",
        ),
    )
    box = {}
    run_id = "controls"
    thread = threading.Thread(target=lambda: box.update(summary=run(cfg, show_progress=False, run_id=run_id)))
    thread.start()
    metrics = tmp_path / "out" / "metrics.jsonl"
    while len(_lines(metrics)) < 2:
        time.sleep(0.05)
    co = ray.get_actor(f"archipelago-{run_id}-coordinator", namespace=NAMESPACE)
    with pytest.raises(ValidationError, match="inner_steps"):  # refused on the caller's side
        SettingsUpdate(inner_steps=0)
    update = UpdateSettings(settings=SettingsUpdate(inner_steps=2, outer_lr=0.5))
    assert ray.get(co.submit.remote(update)) == Ack(detail={"inner_steps": 2, "outer_lr": 0.5})
    assert ray.get(co.submit.remote(Pause())) == Ack(detail={"action": "pause"})
    time.sleep(1.0)
    frozen = len(_lines(metrics))
    time.sleep(1.0)
    assert len(_lines(metrics)) <= frozen + 1 and ray.get(co.status.remote())["paused"]
    ray.get(co.submit.remote(Resume()))
    while len(_lines(metrics)) < frozen + 3:
        time.sleep(0.05)
    status = ray.get(co.status.remote())
    assert status["inner_steps"] == 2 and status["outer_lr"] == 0.5
    ray.get(co.submit.remote(Stop()))
    thread.join(timeout=60)
    summary = box["summary"]
    assert summary["outer_steps"] < 200
    kinds = [json.loads(line)["kind"] for line in _lines(tmp_path / "out" / "events.jsonl")]
    for kind in ("settings", "paused", "resumed", "stop_requested", "stopped"):
        assert kind in kinds
    assert list((tmp_path / "out" / "checkpoint").glob("*/state-*.pt")) and (tmp_path / "out" / "final.pt").exists()
