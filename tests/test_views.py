"""The typed views are what the engine really produces: every status, island view, round
record, event and summary of runs in every mode, with a crash, a join, a drain and a
rejection, validates against the control plane's response models (unknown keys refused),
so the API can never answer a 500 for a view the engine wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from archipelago.orchestrator.bench.simulation.pool import Fault, FaultKind, InProcessPool
from archipelago.orchestrator.engine.build import PhasedRun
from archipelago.orchestrator.engine.commands import AddIslands, Drain
from archipelago.orchestrator.engine.state.views import EventRecord, IslandView, RoundRecord, RunStatus, Summary
from tests.engine_scenarios import drive, scenario_cfg
from tests.helpers import in_process_engine
from tests.test_warm_start import _cfg as warm_cfg


@pytest.mark.parametrize("mode", ["diloco", "ddp", "async", "overlap", "streaming"])
def test_every_view_of_a_run_with_faults_and_joins_is_typed(tmp_path, mode):
    cfg = scenario_cfg(tmp_path, mode, "robust.quarantine_after=3")
    faults = [Fault(FaultKind.CRASH, 1, order=2), Fault(FaultKind.NAN, 2, order=3)]
    engine, _ = in_process_engine(cfg, faults, join_s=2.0)
    seen: list[tuple[dict[str, Any], dict[str, dict[str, Any]]]] = []
    engine.outputs.on_record = lambda status, islands, record: seen.append((status, dict(engine.islands_view)))
    engine.start()
    engine.step()
    RunStatus.model_validate(engine.status())  # before training began
    assert [IslandView.model_validate(v).state.value for v in engine.islands_view.values()] == ["starting"] * 3
    drive(engine, at={2: lambda e: e.submit(AddIslands(count=1)), 4: lambda e: e.submit(Drain(island=0))})
    assert len(seen) == 6
    for status, islands in seen:
        RunStatus.model_validate(status)
        for view in islands.values():
            IslandView.model_validate(view)
    records = [json.loads(line) for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [RoundRecord.model_validate(r).round for r in records] == list(range(1, 7))
    events = [EventRecord.model_validate_json(line) for line in (Path(cfg.out_dir) / "events.jsonl").open()]
    assert {"crash", "join", "drain", "released"} <= {e.kind.value for e in events}
    summary = Summary.model_validate(json.loads((Path(cfg.out_dir) / "summary.json").read_text()))
    assert summary.rounds_done == 6 and summary.islands["1"].state.value == "dead"
    RunStatus.model_validate(engine.status())


def test_a_phased_runs_status_is_typed_in_both_phases(tmp_path):
    statuses: list[dict[str, Any]] = []
    box: dict[str, PhasedRun] = {}

    def pools(cfg, run_id):
        if "run" in box:
            statuses.append(box["run"].status())  # at the fork
        return InProcessPool(cfg)

    run = box["run"] = PhasedRun(warm_cfg(tmp_path), "typed", pools)
    statuses.append(run.status())
    summary = run.execute()
    statuses.append(run.status())
    views = [RunStatus.model_validate(s) for s in statuses]
    assert [v.phase.value for v in views] == ["warm_start", "warm_start", "main"]
    assert views[-1].state.value == "finished" and Summary.model_validate(summary).warm_start is not None
