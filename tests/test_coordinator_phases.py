"""Where the coordinator's time goes (`engine/state/loop_time.py`): exclusive seconds per part of the loop per
recorded round and over the run."""

from __future__ import annotations

import json
import time

import pytest

from archipelago.orchestrator.bench.simulation.config import SimulationConfig
from archipelago.orchestrator.bench.simulation.runner import run_in_process
from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.state.loop_time import LoopClock, Part
from tests.helpers import toy_quadratic


def test_a_phase_inside_another_counts_for_itself_only():
    clock = LoopClock()
    with clock.timed(Part.RECORD):
        time.sleep(0.02)
        with clock.timed(Part.EVALUATE):
            time.sleep(0.05)
    window = clock.take_window()
    assert window["evaluate"] == pytest.approx(0.05, abs=0.02)
    assert window["record"] == pytest.approx(0.02, abs=0.015)  # the evaluation is not counted twice
    assert clock.take_window()["evaluate"] == 0.0  # a new window
    assert clock.totals()["evaluate"] == window["evaluate"]
    with pytest.raises(ValueError), clock.timed(Part.STEP):
        raise ValueError  # a phase that raises still ends
    assert clock.totals()["step"] > 0 and not clock._open


def test_every_round_records_its_coordinator_seconds_and_the_summary_their_totals(tmp_path):
    cfg = load_config(
        None,
        [
            *toy_quadratic(2, 0.0, "data_shards=2"),
            "rounds=4",
            "inner_steps=3",
            f"task.kwargs.fault_dir={tmp_path}",
            f"out_dir={tmp_path / 'out'}",
        ],
    )
    summary = run_in_process(cfg, SimulationConfig(virtual_step_s=0.01))
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4
    for r in records:
        seconds = r["coordinator_seconds"]
        assert set(seconds) == {p.value for p in Part}
        assert all(s >= 0 for s in seconds.values())
        assert seconds["evaluate"] > 0 and seconds["step"] > 0 and seconds["dispatch"] > 0  # every round evaluates
    totals = summary["coordinator_seconds"]
    for part in Part:  # the totals hold every window, and what came after the last record
        assert totals[part.value] >= sum(r["coordinator_seconds"][part.value] for r in records) - 1e-5
    assert sum(totals.values()) <= summary["train_seconds"]
