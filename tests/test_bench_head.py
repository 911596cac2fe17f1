"""`bench head` end to end at its quick size: a real run on a multi-node Ray cluster (the
head node taking no work, an island per node), read back round by round, set beside the
plan of the same config — the head's bytes per round are the plan's (both count what
crosses the head: every island's pseudo-gradient in and the version out), the phases the
report names are measured, and every shipped row is a config the run accepts."""

from __future__ import annotations

import json

import pytest

from archipelago.orchestrator.bench.head import QUICK_ROWS, ROWS, WARM_ROUNDS, head
from archipelago.orchestrator.bench.report import write_result
from archipelago.orchestrator.config_load import validate_config


def test_every_row_is_a_valid_config_of_its_size(tmp_path):
    for row in ROWS + QUICK_ROWS:
        cfg = validate_config(row.config(tmp_path / row.name))
        assert cfg.coordinator.shards == row.slices and cfg.compression.codec == cfg.compression.downlink == row.codec
        assert cfg.checkpoint.every_rounds and cfg.rounds > WARM_ROUNDS + 2  # checkpoint rounds and plain ones


@pytest.mark.ray
def test_bench_head_measures_a_multi_node_round_beside_its_plan(tmp_path):
    result = head(True, tmp_path / "runs")
    write_result(result, tmp_path)
    report = json.loads((tmp_path / "head.json").read_text())
    (row,) = report["methods"].values()
    assert row["params"] > 500_000 and row["islands"] == 2
    # bytes: what the islands sent and received, per steady round, equal to the plan's
    assert abs(row["bytes_ratio"] - 1) <= 0.05, row
    assert row["head_bytes"] == pytest.approx(2 * 2 * 4 * row["params"], rel=0.05)  # fp32 both ways, 2 islands
    phases = row["phases"]
    assert phases["compute"] > 0 and phases["step"] > 0 and phases["checkpoint_write"] > 0
    assert set(row["planned_phases"]) == {"fan_in", "outer_step", "codec", "fan_out", "checkpoint"}
    assert row["measured_seconds"] > phases["compute"] and row["planned_seconds"] > phases["compute"]
    assert [r["round"] for r in row["rounds"]] == list(range(WARM_ROUNDS + 1, QUICK_ROWS[0].rounds + 1))
    assert 0 < report["link"]["gbps"] < 1000
    assert report["machine"]["commit"] and "largest: a round with a checkpoint written <= 1.1x one without" in set(
        report["checks"]
    )
    rates = report["codec_rates"]
    assert rates["decode"]["int4"] > 0 and rates["encode"]["int4"] > rates["decode"]["int4"] / 10
