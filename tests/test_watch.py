"""When an island counts as stuck (`orchestrator/engine/fleet/watch.py`), and that the engine keeps
the times the rule reads: a hung island's news stops, a working island's keeps moving."""

from __future__ import annotations

import json
import time
from pathlib import Path

from archipelago.orchestrator.bench.simulation.pool import Fault, FaultKind
from archipelago.orchestrator.engine.fleet.watch import STUCK_FLOOR_S, UNMEASURED_WORK_S, stuck_after_s, watched
from tests.engine_scenarios import drive, scenario_cfg
from tests.helpers import in_process_engine

NOW = 1_000_000.0


def island(**fields):
    return {"state": "training", "merge": "training", "inner_steps": 50, "steps_per_s": 8.0, **fields}


def test_an_island_with_work_out_is_stuck_after_five_rounds_of_its_own_work():
    assert stuck_after_s(island()) == 5 * 50 / 8.0
    assert not watched(island(last_progress=NOW - 31.0), NOW)["stuck"]
    seen = watched(island(last_progress=NOW - 32.0, last_contribution=NOW - 40.0), NOW)
    assert seen["stuck"] and seen["working"] and seen["progress_age_s"] == 32.0 and seen["contribution_age_s"] == 40.0


def test_a_fast_island_has_a_floor_and_an_unmeasured_one_a_default_round():
    assert stuck_after_s(island(inner_steps=10, steps_per_s=100.0)) == STUCK_FLOOR_S
    assert stuck_after_s(island(steps_per_s=0.0)) == 5 * UNMEASURED_WORK_S


def test_only_an_island_with_work_out_can_be_stuck():
    silent = NOW - 3600.0
    assert not watched(island(merge="waiting", last_progress=silent), NOW)["stuck"]  # its result is in
    assert not watched(island(merge="merged", last_progress=silent), NOW)["stuck"]  # idle: a paused run
    assert not watched(island(state="dead", last_progress=silent), NOW)["stuck"]  # released
    assert watched(island(state="late", last_progress=silent), NOW)["stuck"]  # overdue and still silent
    assert watched(island(), NOW)["progress_age_s"] is None and not watched(island(), NOW)["stuck"]


def test_the_engine_keeps_each_islands_news_and_a_hung_ones_stops(tmp_path):
    """Island 0 hangs on its second work order; the others go on. At the end the hung
    island's last news is its second dispatch, older than every other island's; the
    records say, round by round, how stale each island's results were. (Without heartbeats:
    with them the hung island is released within seconds, and nothing is left to watch.)"""
    cfg = scenario_cfg(tmp_path, "async", "rounds=8", heartbeats=False)
    t0 = time.time()
    engine, _ = in_process_engine(cfg, [Fault(FaultKind.HANG, 0, order=2)])
    drive(engine)
    islands = engine.summary["islands"]
    assert all(t0 <= s["last_progress"] <= time.time() for s in islands.values())
    others = [s["last_progress"] for i, s in islands.items() if i != "0"]
    assert islands["0"]["merge"] == "training" and islands["0"]["last_progress"] < min(others)
    records = [json.loads(line) for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    per_island = [r["island_staleness"] for r in records]
    assert all(set(p) <= {"0", "1", "2"} for p in per_island) and any(p for p in per_island)
    assert all(max(p.values(), default=0) == r["staleness"] for p, r in zip(per_island, records))
    assert not any("0" in p for p in per_island[1:])  # after its first result, island 0 sends nothing
