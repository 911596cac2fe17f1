"""A run with a warm start is one run to its operator: what is asked during the warm start
carries across the fork, and the status says `finished` only when the main phase is.
Before: each phase had its own controls (a pause was lost at the fork, an add made during
the warm start was gone, a stop arriving while the main engine was built was lost), and
`GET /v1/run` answered `finished` (run id `…-warm`) at the end of the warm start."""

from __future__ import annotations

import threading
import time
from typing import Any

from archipelago.orchestrator.bench.simulation.pool import InProcessPool
from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.engine.build import PhasedRun
from archipelago.orchestrator.engine.commands import (
    Ack,
    AddIslands,
    Drain,
    Pause,
    Refusal,
    Resume,
    SettingsUpdate,
    Stop,
    UpdateSettings,
)
from archipelago.orchestrator.engine.state.views import RunStatus
from tests.helpers import events
from tests.test_warm_start import _cfg


class Fork:
    """The pool factory of a `PhasedRun` that runs `at_fork` when the main phase's pool is
    made: after the warm phase ended, while the main engine is being built."""

    def __init__(self, at_fork=None) -> None:
        self.at_fork = at_fork

    def __call__(self, cfg: RunConfig, run_id: str) -> InProcessPool:
        if not run_id.endswith("-warm") and self.at_fork is not None:
            self.at_fork()
        return InProcessPool(cfg)


def _phased(cfg: RunConfig, run_id: str, fork: Fork, at_warm_end=None) -> PhasedRun:
    """A phased run; `at_warm_end(run)` is called once the warm phase recorded its last round."""
    box: dict[str, PhasedRun] = {}

    def on_record(status: RunStatus, _islands: Any, _record: Any) -> None:
        run = box.get("run")
        if run is not None and run.warming and status.round == status.rounds and at_warm_end is not None:
            at_warm_end(run)

    box["run"] = run = PhasedRun(cfg, run_id, fork, on_record=on_record)
    return run


def test_a_pause_made_during_the_warm_start_holds_in_the_main_phase(tmp_path):
    cfg = _cfg(tmp_path)
    run = _phased(cfg, "pause", Fork(), at_warm_end=lambda r: r.inbox.submit(Pause()))
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(summary=run.execute()))
    thread.start()
    deadline = time.time() + 60
    while time.time() < deadline and not (run.status().phase == "main" and run.status().state == "paused"):
        time.sleep(0.01)
    status = run.status()
    assert status.phase == "main" and status.state == "paused" and status.round == 0
    assert run.inbox.submit(Resume()) == Ack(detail={"action": "resume"})
    thread.join(timeout=60)
    assert box["summary"]["state"] == "finished" and box["summary"]["rounds_done"] == 6
    kinds = [e["kind"] for e in events(cfg.out_dir)]
    assert kinds.index("paused") < kinds.index("resumed")


def test_an_add_and_settings_made_during_the_warm_start_reach_the_main_phase(tmp_path):
    cfg = _cfg(tmp_path)

    def ask(run: PhasedRun) -> None:
        assert run.inbox.submit(AddIslands(count=1)) == Ack(detail={"target": 4})
        run.inbox.submit(UpdateSettings(settings=SettingsUpdate(outer_lr=0.25)))
        refused = run.inbox.submit(Drain(island=0))  # the warm phase's islands are not the run's to drain
        assert refused.reason == Refusal.NOT_NOW  # type: ignore[union-attr]

    run = _phased(cfg, "add", Fork(), at_warm_end=ask)
    summary = run.execute()
    assert summary["state"] == "finished" and len(summary["islands"]) == 4
    assert summary["islands"]["3"]["rounds_contributed"] >= 1
    assert run.engine.outer.lr() == 0.25
    assert any(e["kind"] == "target" and e["target"] == 4 for e in events(cfg.out_dir))


def test_a_stop_arriving_while_the_main_engine_is_built_stops_the_run(tmp_path):
    cfg = _cfg(tmp_path)
    box: dict[str, PhasedRun] = {}
    run = box["run"] = PhasedRun(cfg, "stop", Fork(at_fork=lambda: box["run"].inbox.submit(Stop(now=True))))
    summary = run.execute()
    assert summary["state"] == "stopped" and summary["rounds_done"] == 0 and run.phase.value == "main"
    assert (tmp_path / "run" / "warm_start" / "warm_start.json").exists()  # the warm start finished


def test_the_status_is_the_runs_and_never_finished_before_the_main_phase_ends(tmp_path):
    cfg = _cfg(tmp_path)
    seen: list[RunStatus] = []
    box: dict[str, PhasedRun] = {}
    run = box["run"] = PhasedRun(cfg, "status", Fork(at_fork=lambda: seen.append(box["run"].status())))
    warm = run.status()
    summary = run.execute()
    assert warm.phase == "warm_start" and warm.run_id == "status"
    (at_fork,) = seen  # the warm phase has ended, the main engine is being built
    assert at_fork.phase == "warm_start" and at_fork.run_id == "status" and at_fork.state == "starting"
    end = run.status()
    assert summary["state"] == end.state == "finished" and end.phase == "main"
    assert run.inbox.submit(Pause()).reason == Refusal.NOT_NOW  # type: ignore[union-attr]
