"""Heartbeats (`elastic.hang_after_steps`): an island whose inner steps stop advancing is
hung within a few of its step times, not at its deadline and grace; a slow or late island
keeps advancing and keeps its work; each batch is still trained once, in every mode. On
the in-process pool's clock, and on Ray with a real hang (an island stuck in its data)."""

from __future__ import annotations

import itertools
import time

import pytest

from archipelago.orchestrator.bench.simulation.chaos import Strike, TimedFault
from archipelago.orchestrator.bench.simulation.pool import Fault, FaultKind
from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.commands import Refused, SettingsUpdate, UpdateSettings
from archipelago.orchestrator.engine.pool import Progress
from archipelago.orchestrator.runtime.driver import run
from tests.engine_scenarios import check_exactly_once, check_rounds_recorded, drive, run_scenario, scenario_cfg
from tests.helpers import events, in_process_engine, toy_quadratic

# 1 simulated s per inner step, a heartbeat every ½ s: hung after 3 steps without one
BEATS = ("elastic.hang_after_steps=3", "elastic.progress_every_s=0.5", "elastic.hang_floor_s=1")
MODES = ["diloco", "async", "overlap", "streaming", "quorum", "streaming_quorum"]


@pytest.mark.parametrize("mode", MODES)
def test_a_hung_island_is_noticed_by_its_stalled_steps_and_replaced_long_before_its_deadline(tmp_path, mode):
    """Its deadline is 20 simulated s after its work went out, then 100 s of grace; the
    stall is seen 3 step times after its last step, so no deadline ever passes."""
    cfg = scenario_cfg(tmp_path, mode, "rounds=8", *BEATS)
    summary = run_scenario(cfg, [Fault(FaultKind.HANG, 0, order=2)])  # exactly once, every round recorded
    isl = summary["islands"]
    assert isl["0"]["state"] == "dead" and isl["0"]["error"] == "hung: no progress for 3s (elastic.hang_after_steps)"
    assert isl["3"]["state"] == "training" and isl["3"]["rounds_contributed"] >= 1
    assert not any(e["kind"] == "late" for e in events(cfg.out_dir))


def test_a_barrier_round_waits_a_stall_not_a_deadline(tmp_path):
    """Synchronous DiLoCo waits for every island: without heartbeats the hung island's
    round lasts its whole deadline (20 s), with them 3 s past its last step (its frozen count read every ½ s)."""
    slow = run_scenario(
        scenario_cfg(tmp_path, "diloco", "rounds=8", heartbeats=False), [Fault(FaultKind.HANG, 0, order=2)]
    )
    fast = run_scenario(scenario_cfg(tmp_path, "diloco", "rounds=8", *BEATS), [Fault(FaultKind.HANG, 0, order=2)])
    assert fast["clock_seconds"] <= slow["clock_seconds"] - 14, (fast["clock_seconds"], slow["clock_seconds"])


class _Stalling:
    """The coordinator's own evaluation (`LocalEvaluator`), which keeps the engine's thread
    busy for `seconds` of the pool's clock when it evaluates `version`."""

    def __init__(self, inner, pool, version: int, seconds: float) -> None:
        self.inner, self.pool, self.version, self.seconds = inner, pool, version, seconds

    def submit(self, *, version, params, published=None):
        self.inner.submit(version=version, params=params, published=published)
        if version == self.version:
            self.pool.stall(self.seconds)

    def results(self, *, wait):
        return self.inner.results(wait=wait)

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("mode", ["diloco", "quorum"])
def test_a_coordinator_busy_90_s_mid_round_at_the_shipped_settings_declares_no_island_hung(tmp_path, mode):
    """The faults issue's case on the pool's clock: at the shipped settings (a read every
    2 s, 5 step times, a 60-s floor), the engine's thread is blocked 90 s by round 1's
    evaluation while the islands train round 2 (100 steps of 1 s); what they sent meanwhile
    is taken with the time it was sent, so no island is hung, no step lost, each batch
    trained once — while island 1, hung at its round 3, is still declared once its count
    has stood still past the limit."""
    cfg = scenario_cfg(tmp_path, mode, "rounds=4", "inner_steps=100", "round_timeout_s=1000")
    assert (cfg.elastic.hang_after_steps, cfg.elastic.progress_every_s, cfg.elastic.hang_floor_s) == (5, 2.0, 60.0)
    engine, pool = in_process_engine(cfg, [Fault(FaultKind.HANG, 1, order=3)])
    engine.outputs.evaluator = _Stalling(engine.outputs.evaluator, pool, version=1, seconds=90.0)
    drive(engine)
    summary = engine.summary
    check_exactly_once(cfg, summary)
    log = events(cfg.out_dir)
    (crash,) = [e for e in log if e["kind"] == "crash"]
    assert crash["island"] == 1 and crash["reason"].startswith("hung: no progress for 8s"), crash
    assert [e["island"] for e in log if e["kind"] in ("crash", "lost", "late")] == [1, 1], log  # its work only
    assert {i for i, s in summary["islands"].items() if s["state"] == "training"} >= {"0", "2"}
    assert summary["clock_seconds"] >= 90 + 3 * 100  # the stall was on the run's clock


@pytest.mark.parametrize("mode", ["diloco", "async", "quorum"])
def test_a_slow_or_late_island_keeps_advancing_and_keeps_its_work(tmp_path, mode):
    """A quarter-speed island's steps come 4 s apart, within its own limit (3 of its step
    times); a late one's are spread over its longer time: neither is hung."""
    cfg = scenario_cfg(tmp_path, mode, "simulation.slowdown=[1.0,1.0,4.0]", *BEATS)
    engine, _ = in_process_engine(cfg, [Fault(FaultKind.LATE, 1, order=2, seconds=6.0)])
    drive(engine)
    check_exactly_once(cfg, engine.summary)
    check_rounds_recorded(cfg, engine.summary)
    assert all(s["state"] == "training" for s in engine.summary["islands"].values())
    assert not any(e["kind"] == "crash" for e in events(cfg.out_dir))


def test_a_slow_down_in_the_middle_of_a_work_keeps_its_heartbeats_read_on_the_coordinators_clock(tmp_path):
    """A 4× slow-down strikes one island 1.5 s into its 4-s work: its steps now come 4 s
    apart, within its limit (5 step times), and its progress is still read every ½ s with a
    count that follows its slower pace — the reads are the coordinator's, not the island's.
    Read 2 s apart as the island slowed, its count stood still across two reads and it was
    declared hung while it stepped."""
    cfg = scenario_cfg(tmp_path, "diloco", "rounds=2", *BEATS, "elastic.hang_after_steps=5")
    engine, pool = in_process_engine(cfg, step_s=1.0, chaos=[TimedFault(at=1.5, kind=Strike.SLOW, factor=4.0)])
    reads: list[tuple[int, float, int]] = []
    poll = pool.poll

    def heard(timeout, wake=None):
        events = poll(timeout, wake)
        reads.extend((e.island, e.at, e.work_steps) for e in events if isinstance(e, Progress))
        return events

    pool.poll = heard
    drive(engine)
    check_exactly_once(cfg, engine.summary)
    assert not any(e["kind"] == "crash" for e in events(cfg.out_dir))
    # the slowed island's first work: its reads run on past the others' (4 s), every ½ s
    (slowed,) = {i for i, at, _ in reads if 5.0 < at < 11.0}
    times = [at for i, at, _ in reads if i == slowed and at < 11.5]
    assert (
        times[0] == 0.5 and times[-1] >= 11.0 and all(abs(b - a - 0.5) < 1e-9 for a, b in itertools.pairwise(times))
    ), times
    counts = [n for i, at, n in reads if i == slowed and at < 11.5]
    assert counts == sorted(counts) and counts[-1] == 3, counts  # its fourth step ends as the work does


def test_at_the_defaults_a_hang_between_steps_is_declared_within_10_simulated_seconds(tmp_path):
    """Nothing set but the clock (1 simulated s per step): the island hangs halfway through
    its second work (4 of its 8 steps done; its last heartbeat read 2); three 2-s reads
    without a step (more than 5 step times) and it is declared hung, its replacement takes
    its shards, each batch is trained once."""
    cfg = scenario_cfg(tmp_path, "diloco", "rounds=4", "inner_steps=8", heartbeats=True)
    assert cfg.elastic.hang_after_steps == 5 and cfg.elastic.progress_every_s == 2
    engine, pool = in_process_engine(cfg, [Fault(FaultKind.HANG, 0, order=2)], step_s=1.0)
    hung_at = 8.0 + 4.0  # its second work starts at 8 s; it stops after 4 steps
    released: dict[int, float] = {}  # island -> when the pool was told to let it go (its own clock)
    release = pool.release
    pool.release = lambda island: (released.setdefault(island, pool.t), release(island))[1]
    drive(engine)
    check_exactly_once(cfg, engine.summary)
    crash = next(e for e in events(cfg.out_dir) if e["kind"] == "crash")
    assert crash["island"] == 0 and crash["reason"].startswith("hung: no progress for")
    assert hung_at < released[0] <= hung_at + 10, released  # within 10 s of its last step, at the defaults
    assert engine.summary["islands"]["0"]["state"] == "dead"


def test_before_its_first_step_and_after_its_last_an_island_has_the_floor_not_its_step_times():
    """A download, a first step compiling, a state saved after the last step: no step for a
    while is not a hang then; between steps, 5 step times (at least three 2-s reads) are."""
    elastic = load_config(None, []).elastic
    assert elastic.stall_limit_s(1.0, 5, stepping=True) == 6.0  # three reads of 2 s beat 5 steps of 1 s
    assert elastic.stall_limit_s(0.1, 5, stepping=True) == 50.0
    assert elastic.stall_limit_s(1.0, 5, stepping=False) == 60.0  # the floor
    assert elastic.stall_limit_s(0.01, 5, stepping=False) == 500.0  # a slow island's steps exceed it
    assert elastic.stall_limit_s(None, 5, stepping=True) == 60.0  # speed not known yet
    assert elastic.stall_limit_s(1.0, None, stepping=True) is None


def test_without_heartbeats_nothing_is_reported_and_the_deadline_decides(tmp_path):
    cfg = scenario_cfg(tmp_path, "diloco", heartbeats=False)
    engine, pool = in_process_engine(cfg, [Fault(FaultKind.HANG, 0, order=2)])
    drive(engine)
    assert engine.summary["islands"]["0"]["state"] == "late" and not pool.steps_done


@pytest.mark.ray
def test_a_real_hang_on_ray_is_noticed_in_seconds(ray_local, tmp_path):
    """Island 2's process sleeps in its data for an hour from its first round, before any
    speed of its is known (its deadline and grace would take 150 s): its actor still
    answers its heartbeats, with a step count that stops moving, so it is released after
    the 3 s floor and replaced, and the run finishes."""
    sets = toy_quadratic(3, 0.02, "data_shards=3", f"task.kwargs.fault_dir={tmp_path}", f"out_dir={tmp_path / 'out'}")
    cfg = load_config(
        None,
        [
            *sets,
            "rounds=4",
            "inner_steps=10",
            "round_timeout_s=120",
            "elastic.late_grace_s=30",
            "task.kwargs.stall_island=2",
            "task.kwargs.stall_s=3600",
            "elastic.hang_after_steps=10",
            "elastic.progress_every_s=0.5",
            "elastic.hang_floor_s=3",
        ],
    )
    t0 = time.perf_counter()
    summary = run(cfg, show_progress=False)
    assert time.perf_counter() - t0 < 140  # never its deadline and grace (150 s), however loaded the machine
    islands = summary["islands"]
    assert islands["2"]["state"] == "dead" and islands["2"]["error"].startswith("hung: no progress"), islands["2"]
    assert summary["rounds_done"] == 4
    assert any(e["kind"] == "requested" and e["island"] == 3 for e in events(cfg.out_dir))  # its replacement
    shards = summary["shards"]
    assert sum(shards["position"]) == summary["tokens"]  # every batch read was trained, once


def test_the_threshold_is_live_kept_by_a_checkpoint_and_heartbeats_are_not_turned_on_mid_run(tmp_path):
    """At k = 1000 the hung island would wait for its deadline; lowered to 3 after round 1
    (`PATCH /v1/run/settings`), it is hung by its stall. The value is the run's state: the
    status shows it and a checkpoint keeps it. A run without heartbeats refuses it."""
    cfg = scenario_cfg(tmp_path, "diloco", "rounds=8", *BEATS, "elastic.hang_after_steps=1000")
    at = {1: lambda e: e.submit(UpdateSettings(settings=SettingsUpdate(hang_after_steps=3)))}
    engine, _ = in_process_engine(cfg, [Fault(FaultKind.HANG, 0, order=3)])
    drive(engine, at)
    check_exactly_once(cfg, engine.summary)
    assert engine.summary["islands"]["0"]["error"] == "hung: no progress for 3s (elastic.hang_after_steps)"
    assert (
        engine.status().hang_after_steps == 3
        and engine.capture(engine.cfg.checkpoint_dir, "state-x.pt")["settings"]["hang_after_steps"] == 3
    )
    off, _ = in_process_engine(scenario_cfg(tmp_path, "diloco", heartbeats=False))
    refused = off.submit(UpdateSettings(settings=SettingsUpdate(hang_after_steps=3)))
    assert isinstance(refused, Refused) and "has no heartbeats" in refused.message


def test_a_count_read_before_the_island_began_its_work_says_nothing_of_that_work(tmp_path):
    """An answer about the work before (its ticket, its step count) while the new work's
    parameters are still on their way: the island is not between steps of the new work, so
    the floor, not 5 step times, is its limit — a large download is not a hang."""
    from archipelago.orchestrator.engine.pool import Progress

    cfg = scenario_cfg(tmp_path, "diloco", "inner_steps=8", heartbeats=True)
    engine, _ = in_process_engine(cfg, step_s=1.0)
    engine.start()
    while not engine.inflight.in_flight():
        engine.step()
    flight = engine.inflight.in_flight()[0]
    island = flight.work.island
    engine.inflight.progressed(Progress(island=island, steps=20, work_steps=3, ticket=flight.ticket - 100, at=0.0))
    assert flight.work_steps is None and not flight.stepping
    engine.inflight.progressed(Progress(island=island, steps=21, work_steps=3, ticket=flight.ticket, at=0.0))
    assert flight.work_steps == 3 and flight.stepping


def test_bytes_moving_on_its_card_between_steps_are_progress_and_a_still_card_is_not(tmp_path):
    """A download that lasts 60 s with the floor at 10 s: its card moves 1 MB/s, so its
    work has progressed at every read and it is not hung; then the link is cut and only
    Ray's own trickle (4 KB/s, under `MOVING_BYTES_PER_S`) moves: 10 s later it is hung."""
    from archipelago.orchestrator.engine.pool import Progress

    cfg = scenario_cfg(tmp_path, "diloco", "inner_steps=8", "elastic.hang_floor_s=10", heartbeats=True)
    engine, _ = in_process_engine(cfg, step_s=1.0)
    engine.start()
    while not engine.inflight.in_flight():
        engine.step()
    flight = engine.inflight.in_flight()[0]
    island, t0, hangs = flight.work.island, flight.progress_at, engine.inflight.hangs
    for k in range(31):
        engine.inflight.progressed(Progress(island=island, steps=0, at=t0 + 2 * k, card_bytes=2_000_000 * k))
    assert not flight.stepping and flight.progress_at == t0 + 60
    assert hangs.stalled(flight, t0 + 69, None, 3.0) is None
    for k in range(1, 8):
        engine.inflight.progressed(
            Progress(island=island, steps=0, at=t0 + 60 + 2 * k, card_bytes=60_000_000 + 8_000 * k)
        )
    assert flight.progress_at == t0 + 60
    assert hangs.stalled(flight, t0 + 71, None, 3.0) == "hung: no progress for 11s (elastic.hang_after_steps)"


def _ray_beats(tmp_path, batch_s: float, *extra: str):
    """Three islands of the toy task on Ray, H = 40 batches of `batch_s`, heartbeats every ½ s
    with a 3-s floor: what the shipped defaults are (2 s, 60 s), scaled down."""
    sets = toy_quadratic(3, batch_s, "data_shards=3", f"out_dir={tmp_path / 'out'}")
    return load_config(
        None,
        [
            *sets,
            "rounds=2",
            "inner_steps=40",
            "round_timeout_s=120",
            "elastic.hang_after_steps=5",
            "elastic.progress_every_s=0.5",
            "elastic.hang_floor_s=3",
            *extra,
        ],
    )


@pytest.mark.ray
def test_a_coordinator_busy_far_past_the_silence_limit_declares_no_island_hung(ray_local, tmp_path):
    """The coordinator's first evaluation (on the engine's thread, as `evaluation.where:
    coordinator` runs it) takes 6 s while the islands train their 8-s round: asked for
    progress only from the engine's thread, every island was silent for 6 s when it came
    back — past the 3-s floor — and was declared hung and replaced. Heard on a thread of
    their own, none is: no island lost, no step lost, each batch trained once."""
    cfg = _ray_beats(tmp_path, 0.2, "task.kwargs.eval_stall_s=6")
    summary = run(cfg, show_progress=False)
    log = events(cfg.out_dir)
    assert not [e for e in log if e["kind"] in ("crash", "lost", "late")], log
    assert sorted(e["island"] for e in log if e["kind"] == "requested") == [0, 1, 2]  # no replacement
    assert summary["rounds_done"] == 2 and sorted(summary["islands"]) == ["0", "1", "2"]
    shards = summary["shards"]
    assert sum(shards["position"]) == summary["tokens"] == 3 * 2 * 40  # every step of every round, once


@pytest.mark.ray
def test_a_sigstopped_island_answers_nothing_and_is_declared_hung_at_the_floor(ray_local, tmp_path):
    """A frozen process (SIGSTOP: its heartbeats go unanswered, unlike an island stuck in its
    data, which answers with a count that stops) is hung once its silence passes the floor,
    while the other islands, heard all along, keep their work; it is replaced and the run
    finishes with every batch trained once."""
    import os
    import signal

    from archipelago.orchestrator.runtime.island_actors import find_island
    from tests.helpers import run_until_records

    cfg = _ray_beats(tmp_path, 0.1)
    thread, box = run_until_records(cfg, "sigstop", 1)
    handle = find_island("sigstop", 1)
    assert handle is not None
    pid = ray_local.get(handle.actor.identity.remote(), timeout=30)["pid"]
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        while thread.is_alive() and not any(e["kind"] == "crash" for e in events(cfg.out_dir)):
            time.sleep(0.1)
        declared_s = time.monotonic() - stopped_at
    finally:
        os.kill(pid, signal.SIGCONT)
    thread.join(timeout=180)
    summary = box["summary"]
    (crash,) = [e for e in events(cfg.out_dir) if e["kind"] == "crash"]
    assert crash["island"] == 1 and crash["reason"].startswith("hung: no progress"), crash
    # Silence counts from the island's last answer, heard up to one heartbeat (½ s) before the
    # stop: the floor holds from there, and the wall from the stop is at most that much shorter.
    assert int(crash["reason"].split("for ")[1].split("s")[0]) >= 3, crash
    assert 3 - 0.5 <= declared_s < 30, declared_s  # a few reads of slack on a loaded machine
    assert summary["rounds_done"] == 2 and summary["islands"]["1"]["state"] == "dead"
    assert sum(summary["shards"]["position"]) == summary["tokens"]


@pytest.mark.ray
def test_a_dead_spare_is_found_by_its_heartbeat_and_replaced_before_it_is_needed(ray_local, tmp_path):
    """A hot spare has no work out, so nothing but a heartbeat can find it dead: it was found
    only when promoted (a chain of dead spares failed one promotion after another). Killed
    while standing by, it is declared dead within seconds and a new spare is placed behind."""
    from archipelago.orchestrator.runtime.island_actors import find_island
    from tests.helpers import run_until_records

    cfg = _ray_beats(tmp_path, 0.1, "elastic.spares=1")
    thread, box = run_until_records(cfg, "deadspare", 1)
    (index,) = [e["island"] for e in events(cfg.out_dir) if e["kind"] == "join" and e.get("spare")]  # the last to join
    spare = find_island("deadspare", index)
    assert spare is not None
    ray_local.kill(spare.actor, no_restart=True)
    thread.join(timeout=180)
    summary = box["summary"]
    log = events(cfg.out_dir)
    (crash,) = [e for e in log if e["kind"] == "crash"]
    assert crash["island"] == index and "found by its heartbeat" in crash["reason"], log
    assert not [e for e in log if e["kind"] == "promoted"]  # never promoted: found while standing by
    assert any(e["kind"] == "requested" and e["island"] == 4 for e in log)  # the spare placed behind it
    assert summary["rounds_done"] == 2 and sum(summary["shards"]["position"]) == summary["tokens"]
