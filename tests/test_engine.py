"""The round engine without Ray: real islands in this process, a virtual clock, injected
faults (crash, late, hang, NaN, raise) and membership changes (join, drain), in every mode
(stops and coordinator restarts: test_engine_restart.py). Every scenario checks exactly-once data: each batch the
islands read is either trained into the run once or belongs to work the engine declared
lost (and so was read again by its next owner), and Σ positions × batch tokens = tokens
trained = Σ of the islands' tokens."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from archipelago.orchestrator.bench.simulation.pool import Fault, FaultKind
from archipelago.orchestrator.config_operations import RecordsConfig
from archipelago.orchestrator.engine.commands import (
    Ack,
    AddIslands,
    Drain,
    Pause,
    Refusal,
    Refused,
    SetTarget,
    SettingsUpdate,
    UpdateSettings,
)
from archipelago.orchestrator.engine.types import Event, RunFailed
from tests.engine_scenarios import check_exactly_once, drive, run_scenario, scenario_cfg
from tests.helpers import events, in_process_engine

MODES = ["diloco", "ddp", "async", "overlap", "streaming", "quorum", "streaming_quorum", "sync_dylu"]


@pytest.mark.parametrize("mode", MODES)
def test_no_fault_every_mode_trains_each_batch_once(tmp_path, mode):
    summary = run_scenario(scenario_cfg(tmp_path, mode))
    assert summary["state"] == "finished" and summary["rounds_done"] == 6
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


@pytest.mark.parametrize("mode", MODES)
def test_islands_of_different_speeds_every_batch_once(tmp_path, mode):
    cfg = scenario_cfg(tmp_path, mode, "simulation.slowdown=[1.0,1.5,3.0]")
    summary = run_scenario(cfg)
    assert summary["rounds_done"] == 6 and summary["final_eval_loss"] < summary["initial_eval_loss"]
    if mode == "overlap":  # every island that did round t-1 is in round t: none is left out by timing
        records = [json.loads(line) for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
        assert all(r["contributed"] == [0, 1, 2] for r in records)


@pytest.mark.parametrize("mode", MODES)
def test_a_crashed_island_is_replaced_and_its_round_retrained(tmp_path, mode):
    cfg = scenario_cfg(tmp_path, mode)
    summary = run_scenario(cfg, [Fault(FaultKind.CRASH, 1, order=2)])
    isl = summary["islands"]
    assert isl["1"]["state"] == "dead" and "3" in isl and isl["3"]["state"] == "training"
    kinds = [e["kind"] for e in events(cfg.out_dir)]
    assert "crash" in kinds and "lost" in kinds and kinds.count("join") == 4
    assert summary["rounds_done"] == 6 and np.isfinite(summary["final_eval_loss"])


@pytest.mark.parametrize("mode", ["diloco", "overlap", "async", "streaming", "quorum", "streaming_quorum"])
def test_a_late_island_is_left_behind_then_trains_again(tmp_path, mode):
    cfg = scenario_cfg(tmp_path, mode)
    summary = run_scenario(cfg, [Fault(FaultKind.LATE, 2, order=2, seconds=21.0)])
    isl = summary["islands"]
    assert isl["2"]["late_results"] == 1 and isl["2"]["state"] == "training"
    # its first update, and (with rounds left) more after its overdue result arrived
    assert isl["2"]["rounds_contributed"] >= (1 if mode in ("async", "quorum") else 2)
    assert any(e["kind"] == "late" and e["island"] == 2 for e in events(cfg.out_dir))


@pytest.mark.parametrize(("heartbeats", "state"), [(True, "dead"), (False, "late")])
def test_a_hung_island_never_stalls_therun_scenario(tmp_path, heartbeats, state):
    """With heartbeats (as shipped) the hung island is released and replaced; without, it
    is late at its deadline and the run goes on without it either way."""
    cfg = scenario_cfg(tmp_path, "async", heartbeats=heartbeats)
    summary = run_scenario(cfg, [Fault(FaultKind.HANG, 0, order=1)])
    assert summary["rounds_done"] == 6 and summary["islands"]["0"]["state"] == state
    assert summary["islands"]["0"]["rounds_contributed"] == 0


@pytest.mark.parametrize("mode", ["diloco", "async", "overlap", "streaming", "quorum", "streaming_quorum"])
def test_a_hung_island_is_released_after_the_grace_and_replaced(tmp_path, mode):
    """Before: a hung island stayed `late` to the end of the run, holding its resources."""
    cfg = scenario_cfg(tmp_path, mode, "rounds=8", "elastic.late_grace_s=10")
    summary = run_scenario(cfg, [Fault(FaultKind.HANG, 0, order=2)])
    isl = summary["islands"]
    assert isl["0"]["state"] == "dead" and "hung" in isl["0"]["error"]
    assert isl["3"]["state"] == "training" and isl["3"]["rounds_contributed"] >= 1
    assert summary["rounds_done"] == 8


def test_a_round_in_which_every_island_is_late_does_not_fail_therun_scenario(tmp_path):
    cfg = scenario_cfg(tmp_path, "diloco")
    summary = run_scenario(cfg, [Fault(FaultKind.LATE, i, order=2, seconds=25.0) for i in range(3)])
    assert summary["state"] == "finished" and summary["rounds_done"] == 6
    assert all(s["late_results"] == 1 and s["state"] == "training" for s in summary["islands"].values())
    # the empty round took no outer step, and the version says so
    assert summary["outer_steps"] == 5


def test_the_deadline_scales_with_h_so_a_larger_h_is_never_late(tmp_path):
    """Before: a fixed round_timeout_s made every island late once H grew (an in-range
    PATCH of inner_steps, or the shipped k8s config's H = 500), and the run failed."""
    cfg = scenario_cfg(tmp_path, "diloco", "round_timeout_s=5", "step_timeout_s=2")
    summary = run_scenario(cfg, at={2: lambda e: e.submit(UpdateSettings(settings=SettingsUpdate(inner_steps=60)))})
    kinds = [e["kind"] for e in events(cfg.out_dir)]
    assert "settings" in kinds and "late" not in kinds
    assert summary["rounds_done"] == 6 and summary["outer_steps"] == 6


@pytest.mark.parametrize(("factor", "allowed"), [("3", 12.0), ("null", 45.0)])
def test_a_hung_island_is_late_after_a_multiple_of_its_measured_time(tmp_path, factor, allowed):
    """Once an island's speed is known its deadline is `speed_timeout_factor` × the time its
    work should take (3 × 4 steps at 1 step/s here), floored at round_timeout_s; the bound
    round_timeout_s + H × step_timeout_s (45 s here) is only the cap. At the shipped H = 500
    the bound alone let a hung island hold a barrier round for 88 minutes."""
    cfg = scenario_cfg(  # deadlines, not heartbeats, are what is tested here
        tmp_path,
        "diloco",
        "round_timeout_s=5",
        "step_timeout_s=10",
        f"speed_timeout_factor={factor}",
        heartbeats=False,
    )
    summary = run_scenario(cfg, [Fault(FaultKind.HANG, 1, order=3)])
    late = [e for e in events(cfg.out_dir) if e["kind"] == "late"]
    assert [e["island"] for e in late] == [1] and late[0]["deadline_s"] == pytest.approx(allowed)
    assert summary["rounds_done"] == 6


def test_rejected_updates_give_their_batches_back_and_take_no_step(tmp_path):
    """Before: a round whose every update was rejected still advanced the version, and the
    rejected batches counted as trained though they never reached the model."""
    cfg = scenario_cfg(tmp_path, "diloco", "robust.quarantine_after=3")
    summary = run_scenario(cfg, [Fault(FaultKind.NAN, i, order=2) for i in range(3)])
    assert summary["rounds_done"] == 6 and summary["outer_steps"] == 5
    lost = [e for e in events(cfg.out_dir) if e["kind"] == "lost"]
    assert len(lost) == 3 and all(e["reason"].startswith("rejected (non-finite") for e in lost)
    assert summary["tokens"] == summary["tokens_applied"]  # nothing counted that the model did not get


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_measures_island_speed(tmp_path, mode):
    """Before: in diloco (and ddp, overlap) every island's steps_per_s was 0.0."""
    cfg = scenario_cfg(tmp_path, mode, "simulation.slowdown=[1.0,2.0,4.0]")
    summary = run_scenario(cfg)
    speeds = [summary["islands"][str(i)]["steps_per_s"] for i in range(3)]
    assert speeds == pytest.approx([1.0, 0.5, 0.25], rel=0.01)


def test_nan_updates_are_rejected_then_the_island_is_quarantined(tmp_path):
    cfg = scenario_cfg(tmp_path, "diloco", "robust.quarantine_after=2", "elastic.replace_dead=false")
    faults = [Fault(FaultKind.NAN, 2, order=n) for n in (2, 3)]
    engine, _ = in_process_engine(cfg, faults)
    before = engine.flat.data.clone()
    drive(engine)
    summary = engine.summary
    check_exactly_once(cfg, summary)
    assert summary["islands"]["2"]["state"] == "quarantined" and summary["islands"]["2"]["rejections"] == 2
    assert np.isfinite(engine.flat.data.numpy()).all() and not engine.flat.data.equal(before)
    rejections = [e for e in events(cfg.out_dir) if e["kind"] == "rejection"]
    assert len(rejections) == 2 and all(e["reason"].startswith("non-finite") for e in rejections)


@pytest.mark.parametrize("mode", ["diloco", "overlap", "async", "streaming", "quorum", "streaming_quorum"])
def test_a_quarantine_under_restart_keeps_the_results_its_close_applied(tmp_path, mode):
    """Island 0's second update is NaN, and one bad update quarantines it; the failure
    policy restarts the run (every piece of work not yet stepped is given up). Before: the
    verdict reached the fleet in the middle of settling its close, so the restart gave up
    the results that close had just applied (their batches rolled back and trained again)
    and settling the next one raised KeyError. Now the verdicts are handed over once the
    close is settled: every batch is trained once, every round is recorded once."""
    cfg = scenario_cfg(tmp_path, mode, "robust.quarantine_after=1", "simulation.restart_s=30", "robust.norm_ratio=null")
    summary = run_scenario(cfg, [Fault(FaultKind.NAN, 0, order=2)])  # checks every batch was trained once
    assert summary["islands"]["0"]["state"] == "quarantined" and summary["rounds_done"] == 6
    assert [e["kind"] for e in events(cfg.out_dir)].count("restart") == 1  # rounds: checked by run_scenario


def test_nan_update_on_a_sliced_coordinator_leaves_the_model_finite(tmp_path):
    cfg = scenario_cfg(tmp_path, "overlap", "coordinator.shards=2", "compression.chunk=16")
    summary = run_scenario(cfg, [Fault(FaultKind.NAN, 0, order=3)])
    assert summary["islands"]["0"]["rejections"] == 1 and np.isfinite(summary["final_eval_loss"])


def test_an_island_whose_code_raises_is_released_and_replaced(tmp_path):
    cfg = scenario_cfg(tmp_path, "diloco")
    summary = run_scenario(cfg, [Fault(FaultKind.RAISE, 0, order=3)])
    assert summary["islands"]["0"]["state"] == "dead" and "raised" in summary["islands"]["0"]["error"]


@pytest.mark.parametrize("mode", ["diloco", "async", "overlap", "streaming", "quorum", "streaming_quorum"])
def test_join_and_drain_midrun_scenario(tmp_path, mode):
    cfg = scenario_cfg(tmp_path, mode)
    summary = run_scenario(cfg, at={2: lambda e: e.submit(AddIslands(count=1)), 4: lambda e: e.submit(Drain(island=0))})
    isl = summary["islands"]
    assert isl["3"]["rounds_contributed"] >= 1 and isl["3"]["joined_version"] > 0
    assert isl["0"]["state"] == "drained"
    kinds = [(e["kind"], e.get("island")) for e in events(cfg.out_dir)]
    assert ("drain", 0) in kinds and ("released", 0) in kinds and ("join", 3) in kinds
    assert ("requested", 4) not in kinds  # the drained island was not replaced: target 3 + 1 - 1


@pytest.mark.parametrize("mode", ["diloco", "async", "overlap", "streaming", "quorum", "streaming_quorum"])
def test_an_island_without_a_free_shard_never_holds_a_round_open(tmp_path, mode):
    """More islands than data shards: one island gets no shard to train. It must sit the
    round out, not be waited for (overlap's close waits for islands about to start a round:
    this hung a chaos run whose joins outnumbered the shards)."""
    cfg = scenario_cfg(tmp_path, mode, "data_shards=4", "rounds=8")
    summary = run_scenario(cfg, at={2: lambda e: e.submit(AddIslands(count=2))})
    assert summary["rounds_done"] == 8 and len(summary["islands"]) == 5


@pytest.mark.parametrize("sim", ["simulation.slowdown=[1.0,2.0,3.0]", "simulation.links=[{},{},{preset: wan-1g}]"])
def test_simulated_speeds_and_links_survive_joins_and_replacements(tmp_path, sim):
    """Per-island simulation lists cover the initial islands; a joiner or a replacement (an
    index past the list) used to crash the run with IndexError."""
    cfg = scenario_cfg(tmp_path, "async", sim)
    summary = run_scenario(cfg, [Fault(FaultKind.CRASH, 1, order=2)], at={2: lambda e: e.submit(AddIslands(count=1))})
    assert summary["rounds_done"] == 6 and {"3", "4"} <= set(summary["islands"])


def test_operator_commands_compose_within_a_round(tmp_path):
    """Commands given between two engine steps: two adds make +2 (each used to read the
    stale target: both answered 4), a target then an add compose, and draining below
    elastic.min_islands is refused when asked (DELETE on every island emptied the run)."""
    cfg = scenario_cfg(tmp_path, "diloco", "elastic.min_islands=2")
    engine, _ = in_process_engine(cfg)
    engine.start()
    engine.step()
    assert engine.submit(AddIslands(count=1)) == Ack(detail={"target": 4})
    assert engine.submit(AddIslands(count=1)) == Ack(detail={"target": 5})
    assert engine.submit(SetTarget(islands=3)) == Ack(detail={"target": 3})
    assert engine.submit(AddIslands(count=2)) == Ack(detail={"target": 5})
    engine.step()
    assert engine.members.target == 5
    for i in range(3):
        assert engine.submit(Drain(island=i)) == Ack(detail={"draining": i})
    refused = engine.submit(Drain(island=3))
    assert isinstance(refused, Refused) and refused.reason == Refusal.OUT_OF_BOUNDS
    assert "below elastic.min_islands" in refused.message
    assert engine.submit(Drain(island=99)).reason == Refusal.UNKNOWN_ISLAND  # type: ignore[union-attr]
    assert engine.submit(SetTarget(islands=1)).reason == Refusal.OUT_OF_BOUNDS  # type: ignore[union-attr]
    engine.step()
    again = engine.submit(Drain(island=0))
    assert isinstance(again, Refused) and again.reason == Refusal.NOT_NOW and "not training" in again.message
    while engine.step():
        pass
    assert engine.summary["rounds_done"] == 6 and engine.members.target == 2
    assert sorted(i for i, s in engine.summary["islands"].items() if s["state"] == "drained") == ["0", "1", "2"]
    assert engine.submit(Pause()) == Refused(reason=Refusal.NOT_NOW, message="the run has ended")


def test_the_event_cursor_survives_trimming(tmp_path):
    from archipelago.orchestrator.engine.state.records import EventLog

    log = EventLog(tmp_path / "events.jsonl", RecordsConfig(), keep=5)
    for i in range(12):
        log.add(Event.TARGET, target=i)
    assert [e.as_dict()["target"] for e in log.since(10)] == [10, 11]  # was [] once more than `keep` existed
    assert [e.as_dict()["target"] for e in log.since(0)] == [7, 8, 9, 10, 11]  # a reader far behind: what is kept
    assert log.since(12) == []
    resumed = EventLog(tmp_path / "events.jsonl", RecordsConfig(), keep=5, append=True)  # a restarted coordinator
    resumed.add(Event.RESTART)
    assert resumed.count == 13 and [e.kind for e in resumed.since(12)] == [Event.RESTART]


def test_drain_abandon_gives_its_batches_to_the_next_owner(tmp_path):
    cfg = scenario_cfg(tmp_path, "async", "elastic.drain=abandon")
    summary = run_scenario(cfg, at={2: lambda e: e.submit(Drain(island=1))})
    assert summary["islands"]["1"]["state"] == "drained"


def test_no_island_left_fails_with_the_reason(tmp_path):
    cfg = scenario_cfg(tmp_path, "diloco", "islands.count=1", "elastic.placement_timeout_s=30")
    engine, _pool = in_process_engine(cfg, [Fault(FaultKind.CRASH, 0, order=2)], unplaceable={1})
    with pytest.raises(RunFailed, match="island 0: dead"):
        drive(engine)


def test_overlap_rounds_start_where_the_round_before_ended(tmp_path):
    """The defect this engine fixes: an island handed round t+1 as soon as it returned
    round t started from the shard positions of round t (every second round retrained)."""
    cfg = scenario_cfg(tmp_path, "overlap", "islands.count=2", "data_shards=2")
    engine, pool = in_process_engine(cfg)
    drive(engine)
    starts: dict[int, list[int]] = {}
    for order in pool.dispatched:
        starts.setdefault(order.island, []).append(order.shards[order.island])
    assert starts == {0: [0, 4, 8, 12, 16, 20], 1: [0, 4, 8, 12, 16, 20]}
    check_exactly_once(cfg, engine.summary)


def test_an_island_misreporting_its_data_is_refused_not_trusted(tmp_path):
    """Before: shard positions and tokens reported by an island were trusted (a wrong
    position raised out of the engine; tokens on other shards were committed)."""
    cfg = scenario_cfg(tmp_path, "diloco", "robust.quarantine_after=2")
    summary = run_scenario(cfg, [Fault(FaultKind.MISREPORT, 1, order=n) for n in (2, 3)])
    assert summary["islands"]["1"]["state"] == "quarantined"
    rejections = [e for e in events(cfg.out_dir) if e["kind"] == "rejection" and e["island"] == 1]
    assert len(rejections) == 2 and all("shards [19]" in e["reason"] for e in rejections)
    assert summary["rounds_done"] == 6


def test_the_islands_view_shows_islands_still_joining(tmp_path):
    engine, _ = in_process_engine(scenario_cfg(tmp_path, "diloco"), join_s=5.0)
    engine.start()
    engine.step()
    assert sorted(engine.islands_view) == ["0", "1", "2"]
    assert {v["state"] for v in engine.islands_view.values()} == {"starting"}


def test_control_plane_reads_never_race_the_training_thread(tmp_path):
    """The API's threads read while the engine trains: they must never iterate what the
    engine mutates (a 'changed size during iteration' error is a 500)."""
    import threading

    cfg = scenario_cfg(tmp_path, "async", "rounds=40")
    engine, _ = in_process_engine(cfg)
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                engine.status()
                json.dumps(engine.islands_view)
                engine.events.since(0, 50)
                engine.recorder.page(0, 50)
            except BaseException as err:  # any error is the failure this test looks for
                errors.append(err)
                return
            time.sleep(0.0005)  # hundreds of reads a second each, not a GIL-bound spin

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        drive(engine)
    finally:
        done.set()
        for t in readers:
            t.join()
    assert not errors and engine.summary["rounds_done"] == 40


def test_every_record_carries_the_version_its_round_produced(tmp_path):
    """Two rounds can close in one step (under the one-round lag, a round held open by a
    slow island that dies closes together with the next one, already delivered): before,
    both were recorded with the later version, and a checkpoint written then paired
    rounds with the wrong version."""
    cfg = scenario_cfg(tmp_path, "overlap", "rounds=8", "simulation.slowdown=[1.0,1.0,3.0]")
    # the slow island dies in round 3 while the others already delivered round 4
    summary = run_scenario(cfg, [Fault(FaultKind.CRASH, 2, order=3)])
    records = [json.loads(line) for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == list(range(1, 9))
    assert [r["version"] for r in records] == list(range(1, 9)) and summary["outer_steps"] == 8


def test_dylu_sizes_a_slow_islands_first_work_from_its_known_speed(tmp_path):
    """No cold start at full H: a new island's speed is known (virtual clock) or probed
    (Ray: `Island.probe`) when it joins, so the slow island's first work is already short."""
    cfg = scenario_cfg(tmp_path, "async", "inner_steps=8", "simulation.slowdown=[1.0,1.0,4.0]")
    engine, pool = in_process_engine(cfg)
    drive(engine, until=1)
    first = {}
    for order in pool.dispatched:
        first.setdefault(order.island, order.steps)
    assert first == {0: 8, 1: 8, 2: 2}


@pytest.mark.parametrize("mode", ["overlap", "diloco", "async"])
def test_an_upload_crossing_its_link_holds_only_the_step_that_merges_it(tmp_path, mode):
    """Each transfer takes 1 s (virtual) against 4 s of compute per work order. The step
    waits for the pseudo-gradients to cross, but the engine does not sleep meanwhile: under
    the one-round lag the islands start their next round at once, so only the transfers
    of the synchronous start (the first download, upload, and version 1's download) and
    the last upload show: 24 + 4 s (the engine used to sleep through every upload, so each
    lagged round paid it too: 32 s). Synchronous rounds pay the whole exchange, 6 × (4 + 2)
    s, and an asynchronous island, which restarts from the step that merges its own
    update, waits for that step and its download."""
    cfg = scenario_cfg(tmp_path, mode, "simulation.link.latency_ms=1000")
    summary = run_scenario(cfg)
    compute = cfg.rounds * cfg.inner_steps  # 1 s per inner step on the in-process pool
    expected = {"overlap": compute + 4, "diloco": compute + cfg.rounds * 2, "async": compute + cfg.rounds * 2}
    assert summary["clock_seconds"] == pytest.approx(expected[mode], abs=0.01)


def test_what_the_coordinator_keeps_per_version_and_per_island_stays_bounded(tmp_path):
    """Publication times were never pruned (≈ 54 MiB by 640 k async versions) and every
    record listed H for every island ever seen (29 KiB a line after 2,000 replacements)."""
    cfg = scenario_cfg(tmp_path, "async", "rounds=8")
    engine, _ = in_process_engine(cfg, [Fault(FaultKind.CRASH, 1, order=2)])
    drive(engine)
    assert engine.run.version >= 20 and len(engine.publisher.published_at) <= 3
    last = json.loads((Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()[-1])
    dead = {i for i, s in engine.summary["islands"].items() if s["state"] == "dead"}
    assert dead == {"1"} and not dead & set(last["inner_steps"]) and len(last["inner_steps"]) == 3


@pytest.mark.parametrize("mode", ["async", "quorum"])
def test_a_close_that_completes_several_rounds_records_and_checkpoints_each(tmp_path, mode):
    """H lowered mid-run (as the REST chaos run did) makes the next close cover more than one
    round of the token budget. The arrival pacings returned only the last round it
    completed: its records skipped rounds (28 of 30 under churn) and, on a multiple of
    `every_rounds`, their checkpoints."""
    cfg = scenario_cfg(tmp_path, mode)
    summary = run_scenario(cfg, at={2: lambda e: e.submit(UpdateSettings(settings=SettingsUpdate(inner_steps=1)))})
    records = [json.loads(line) for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == list(range(1, cfg.rounds + 1))  # each round once, in order
    checkpointed = [e["round"] for e in events(cfg.out_dir) if e["kind"] == Event.CHECKPOINT.value]
    assert checkpointed == list(range(1, cfg.rounds + 1))  # every_rounds = 1: every one due is taken
    assert summary["rounds_done"] == cfg.rounds


@pytest.mark.parametrize("mode", ["diloco", "async", "quorum", "overlap", "streaming"])
def test_a_paused_run_takes_no_outer_step_until_it_resumes(tmp_path, mode):
    """Paused in an asynchronous mode, results already out used to be stepped: the run went
    from version 3 to 4 with its status saying paused. They now wait for the resume."""
    from archipelago.orchestrator.engine.commands import Resume
    from archipelago.orchestrator.engine.types import RunPhase

    cfg = scenario_cfg(tmp_path, mode)
    engine, _ = in_process_engine(cfg)
    engine.start()
    while engine.rounds_done < 2:
        assert engine.step()
    assert engine.submit(Pause()) == Ack(detail={"action": "pause"})
    versions, steps = set(), 0
    while steps < 400 and (engine.phase != RunPhase.PAUSED or engine.in_flight):  # until what was out is back
        assert engine.step()
        steps += 1
        if engine.phase == RunPhase.PAUSED:
            versions.add(engine.run.version)
    for _ in range(20):  # and stays paused
        assert engine.step()
        versions.add(engine.run.version)
    assert engine.phase == RunPhase.PAUSED and engine.status().paused and len(versions) == 1, versions
    assert engine.submit(Resume()) == Ack(detail={"action": "resume"})
    while engine.step():
        pass
    assert engine.summary["rounds_done"] == cfg.rounds and engine.summary["state"] == "finished"
    check_exactly_once(cfg, engine.summary)


def test_the_phase_moves_only_by_its_machines_transitions_and_the_status_shows_each_move(tmp_path):
    """One owner of the phase (`engine/state/lifecycle.py`): a move it has no row for is
    an engine bug raised at once, not a status that says one thing while the engine does
    another; every phase is reachable from the start; an ended run only fails."""
    from archipelago.orchestrator.engine.state.lifecycle import NEXT, Lifecycle, PhaseError
    from archipelago.orchestrator.engine.types import RunPhase

    seen: list[RunPhase] = []
    life = Lifecycle()
    life.listen(seen.append)
    for phase in (RunPhase.TRAINING, RunPhase.PAUSED, RunPhase.PAUSED, RunPhase.TRAINING, RunPhase.STOPPED):
        life.to(phase)
    assert seen == [RunPhase.TRAINING, RunPhase.PAUSED, RunPhase.TRAINING, RunPhase.STOPPED] and life.ended
    with pytest.raises(PhaseError, match="from stopped to training"):
        life.to(RunPhase.TRAINING)
    reached, frontier = {RunPhase.STARTING}, [RunPhase.STARTING]
    while frontier:
        for nxt in NEXT[frontier.pop()] - reached:
            reached.add(nxt)
            frontier.append(nxt)
    assert reached == set(RunPhase)

    engine, _ = in_process_engine(scenario_cfg(tmp_path, "diloco", "rounds=2"))
    moves = []
    engine.lifecycle.listen(lambda p: moves.append((p, engine.status().state)))
    engine.execute()
    assert moves == [(RunPhase.TRAINING, RunPhase.TRAINING), (RunPhase.FINISHED, RunPhase.FINISHED)]


def test_the_status_of_a_sliced_run_never_asks_a_slice(tmp_path):
    """Before: every `GET /v1/run` read the outer lr from every slice, unbounded, behind a
    slice's part save; three slow reads took the coordinator's three control threads and a
    Stop went unanswered, and a dead slice turned reads into 500s. The status now serves the
    lr the engine's own thread last read (each round) or set: a slice that would never
    answer does not hold it."""
    import threading

    cfg = scenario_cfg(tmp_path, "diloco", "coordinator.shards=2", "compression.chunk=16", "outer.lr=0.7")
    engine, _ = in_process_engine(cfg)
    drive(engine, until=2)
    never = threading.Event()
    for part in engine.outer.calls.slices:
        part.lr = lambda: never.wait(5)  # a slice that does not answer (for 5 s)
    began = time.monotonic()
    assert engine.status().outer_lr == pytest.approx(0.7) and time.monotonic() - began < 1.0
    engine.outer.set_lr(0.3)  # as the engine's thread applies an accepted `UpdateSettings`
    assert engine.status().outer_lr == pytest.approx(0.3)
