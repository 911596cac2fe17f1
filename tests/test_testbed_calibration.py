"""The simulator's calibration on the testbed (`orchestrator/bench/testbed_calibration.py`):
each testbed row maps to a simulated run of the same workload and mode on the testbed's
measured rates; a row the simulator cannot run is reported null with its reason, never
given a ratio."""

from __future__ import annotations

import pytest

from archipelago.orchestrator.bench import testbed_workload as testbed
from archipelago.orchestrator.bench.testbed_calibration import (
    CALIBRATION_HEADING,
    UNSIMULATED,
    UnknownRow,
    calibrate,
    first_at_or_below,
    fleet_of,
    judge,
    settings,
    with_section,
)
from archipelago.orchestrator.config import Mode
from archipelago.orchestrator.config_load import load_config


@pytest.mark.parametrize("row", [r for r in testbed.ROWS if r not in UNSIMULATED])
def test_every_testbed_row_but_powersgd_is_simulated_with_the_testbeds_workload(row):
    cfg = load_config(None, settings(row, seed=1))
    assert cfg.islands.count == testbed.ISLANDS and cfg.seed == 1 and cfg.inner.lr == testbed.LR
    assert cfg.warm_start.steps == 0
    assert cfg.inner_steps * cfg.rounds == testbed.H * testbed.ROUNDS  # the same schedule's steps
    if row.startswith("ddp"):
        assert cfg.mode.name == Mode.DDP and cfg.inner_steps == testbed.H // 2  # evaluated as often as its reference
        assert cfg.compression.codec == {"ddp_fp32": "none", "ddp_bf16": "bf16"}[row]
    else:
        assert cfg.inner_steps == testbed.H
        assert load_config(None, [a.removeprefix("--set=") for a in testbed.ARCHIPELAGO[row]]).mode == cfg.mode


def test_the_simulated_fleet_is_the_testbeds_links_and_head():
    sim = fleet_of(island_mbit=19.2, step_s=0.44)
    assert sim.virtual_step_s == 0.44 and sim.link.gbps == pytest.approx(0.0192) and sim.link.latency_s == 0.0
    assert sim.head_gbps == pytest.approx(testbed.ISLANDS * 0.0192) and sim.price_head and sim.ddp_overlap


def test_a_row_the_simulator_cannot_run_is_null_with_its_reason(tmp_path):
    regimes = {"1gbps": {"island_mbit": 1.9, "rows": {"ddp_powersgd": {"seconds_to_target": 408.6}}}}
    got = calibrate(regimes, step_s=0.44, target=2.6, work=tmp_path)
    row = got["regimes"]["1gbps"]["ddp_powersgd"]
    assert row["measured_s"] == 408.6 and row["simulated_s"] is None and row["ratio"] is None and row["ok"] is None
    assert "PowerSGD" in row["why"] and got["tolerance"] == [0.8, 1.25]
    assert not any(tmp_path.iterdir())  # nothing was simulated


def test_a_row_is_timed_at_its_first_record_at_or_below_the_target_as_the_testbed_times_it():
    curve = [(0.0, 5.0), (50.0, 3.1), (100.0, 2.7), (150.0, 2.5), (200.0, 2.4)]
    assert first_at_or_below(curve, 2.6) == 150.0  # not 125 (interpolated)
    assert first_at_or_below(curve, 2.0) is None
    assert first_at_or_below([(0.0, 2.5), (50.0, 2.4)], 2.6) == 50.0  # the initial evaluation is not a record


def test_a_ratio_outside_the_tolerance_is_a_miss_and_an_unreached_side_is_null_with_its_reason():
    assert judge(100.0, 90.0) == {"measured_s": 100.0, "simulated_s": 90.0, "ratio": 0.9, "ok": True}
    assert judge(100.0, 130.0)["ok"] is False and judge(100.0, 79.0)["ok"] is False
    unreached = judge(None, 90.0)
    assert unreached["ratio"] is None and unreached["ok"] is None and "testbed" in unreached["why"]
    assert "simulated" in judge(100.0, None)["why"]
    with pytest.raises(UnknownRow, match="ddp_fp8"):
        settings("ddp_fp8", 0)


def test_the_calibration_section_replaces_its_old_one_and_keeps_the_plot():
    page = "# r\n\n### a\n\ntable\n\n![testbed](testbed.png)\n"
    once = with_section(page, f"{CALIBRATION_HEADING}\n\nfirst\n")
    assert once.index("first") < once.index("![testbed]") and once.index("### a") < once.index("first")
    twice = with_section(once, f"{CALIBRATION_HEADING}\n\nsecond\n")
    assert "first" not in twice and twice.count(CALIBRATION_HEADING) == 1 and twice.rstrip().endswith("(testbed.png)")
