"""`bench head` end to end at its quick size: a real run on a multi-node Ray cluster (the
head node taking no work, an island per node), read back round by round, set beside the
plan of the same config — the head's bytes per round are the plan's (both count what
crosses the head: every island's pseudo-gradient in and the version out), the phases the
report names are measured, and every shipped row is a config the run accepts."""

from __future__ import annotations

import dataclasses
import json

import pytest

from archipelago.orchestrator.bench.head import (
    CHECKPOINT_ROW,
    PLAIN_ROW,
    QUICK_ROWS,
    ROWS,
    WARM_ROUNDS,
    checkpoint_check,
    head,
)
from archipelago.orchestrator.bench.report import write_result
from archipelago.orchestrator.config_load import validate_config


def test_every_row_is_a_valid_config_of_its_size(tmp_path):
    for row in ROWS + QUICK_ROWS:
        cfg = validate_config(row.config(tmp_path / row.name))
        assert cfg.coordinator.shards == row.slices and cfg.compression.codec == cfg.compression.downlink == row.codec
        assert bool(cfg.checkpoint.every_rounds) == row.checkpoints and cfg.rounds > WARM_ROUNDS + 2
    pair = {row.name: row for row in ROWS if row.name in (CHECKPOINT_ROW, PLAIN_ROW)}
    assert pair[CHECKPOINT_ROW].checkpoints and not pair[PLAIN_ROW].checkpoints  # the same run but for that
    assert dataclasses.replace(pair[PLAIN_ROW], name=CHECKPOINT_ROW, checkpoints=True) == pair[CHECKPOINT_ROW]


def test_a_checkpoint_costs_what_it_adds_to_the_run_whichever_round_its_write_ends_in():
    """A write that ends in the round after the one it began in makes the rounds it began
    in look cheap (0.8× the others in a measured run): the cost is taken against the run
    without checkpoints instead — here 0.5 s a round more, a checkpoint every 2 rounds, over
    a 10-s round: 1.10×."""
    methods = {CHECKPOINT_ROW: {"measured_seconds": 10.5}, PLAIN_ROW: {"measured_seconds": 10.0}}
    ((name, check),) = checkpoint_check(methods).items()
    assert check["value"] == pytest.approx(1.0 + 2 * 0.5 / 10.0) and check["ok"]
    methods[CHECKPOINT_ROW]["measured_seconds"] = 10.6
    assert not checkpoint_check(methods)[name]["ok"]
    assert checkpoint_check({CHECKPOINT_ROW: methods[CHECKPOINT_ROW]}) == {}  # no pair (the quick rows): no check


@pytest.mark.ray
def test_bench_head_measures_a_multi_node_round_beside_its_plan(tmp_path):
    result = head(True, tmp_path / "runs")
    write_result(result, tmp_path)
    report = json.loads((tmp_path / "head.json").read_text())
    (row,) = report["methods"].values()
    (asked,) = report["rows"]  # the row as asked for, beside what it measured and planned
    for key in ("params", "islands", "slices", "codec", "phases", "measured_seconds", "planned_seconds", "head_bytes"):
        assert asked[key] == row[key], key
    assert asked["planned_head_bytes"] == row["planned_head_bytes"] and asked["rounds"] == QUICK_ROWS[0].rounds
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
    assert report["machine"]["commit"]
    rates = report["codec_rates"]
    assert rates["decode"]["int4"] > 0 and rates["encode"]["int4"] > rates["decode"]["int4"] / 10
