"""What a long run meets in the real world, in the engine without Ray: results that cannot
be decoded or trusted, an island's clock far off, a disk that fills mid-run, an error
nothing foresaw. Each scenario failed before the engine screened results, kept its own
clock and survived its disk: the run ended with a traceback, slept until 1e18, or lost
its checkpoints."""

from __future__ import annotations

import errno
import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from archipelago.orchestrator.bench.simulation.pool import Fault, FaultKind
from archipelago.orchestrator.engine.build import build_engine
from archipelago.orchestrator.engine.outcomes import Halt, Lost, Place, Release
from archipelago.orchestrator.engine.state import records
from archipelago.orchestrator.engine.state.checkpoints import load_checkpoint
from archipelago.orchestrator.engine.types import IslandState, RunFailed, RunPhase
from archipelago.workers.runtime import storage
from archipelago.workers.wire.flat import slice_bounds
from archipelago.workers.wire.messages import Sliced
from tests.engine_scenarios import check_exactly_once, drive, run_scenario, scenario_cfg
from tests.helpers import events, in_process_engine

MALFORMED = {
    "unknown codec": {"zstd": np.zeros(2, np.float32)},
    "no payload": None,
    "integer values": {"raw": np.full(2, 1 << 40, np.int64)},  # its squared norm overflows to 0
    "2-D values": {"raw": np.zeros((1, 2), np.float32)},
    "too few values": {"raw": np.zeros(1, np.float32)},
    "int4 that lies about its length": {
        "int4": np.zeros(1, np.uint8),
        "n": np.array([99], np.int64),
        "scale": np.ones(1, np.float32),
        "chunk": np.array([16], np.int32),
    },
}


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_a_malformed_result_is_refused_and_its_island_quarantined(tmp_path, what):
    cfg = scenario_cfg(tmp_path, "diloco", "robust.quarantine_after=2")
    faults = [Fault(FaultKind.MALFORMED, 1, order=n, payload=MALFORMED[what]) for n in (2, 3)]
    summary = run_scenario(cfg, faults)
    assert summary["state"] == "finished" and summary["rounds_done"] == 6
    assert summary["islands"]["1"]["state"] == "quarantined" and summary["islands"]["1"]["rejections"] == 2
    refused = [e for e in events(cfg.out_dir) if e["kind"] == "rejection" and e["island"] == 1]
    assert len(refused) == 2 and all(e["reason"].startswith("malformed") for e in refused)
    assert np.isfinite(summary["final_eval_loss"])


def test_a_2d_slice_on_a_sliced_coordinator_is_refused(tmp_path):
    cfg = scenario_cfg(tmp_path, "diloco", "coordinator.shards=2", "compression.chunk=16", "robust.quarantine_after=2")
    bad = Sliced(parts=tuple({"raw": np.zeros((1, hi - lo), np.float32)} for lo, hi in slice_bounds(2, 2, 16)))
    summary = run_scenario(cfg, [Fault(FaultKind.MALFORMED, 0, order=n, payload=bad) for n in (2, 3)])
    assert summary["islands"]["0"]["state"] == "quarantined" and summary["rounds_done"] == 6


def test_a_slice_that_does_not_decode_is_reported_unfit_by_its_slice():
    """Under Ray a slice's part stays in the island's object store until the slice fetches it:
    the slice checks it (the engine cannot) and reports it unfit instead of raising."""
    from archipelago.orchestrator.config import RunConfig
    from archipelago.orchestrator.engine.step.rules import outer_rule
    from archipelago.orchestrator.engine.step.slices import OuterSlice

    part = OuterSlice(outer_rule(RunConfig()), (0, 4), np.zeros(4, np.float32))
    good = {"raw": np.ones(4, np.float32)}
    stats = part.inspect(
        0, [(0, good), (1, {"raw": np.zeros((2, 2), np.float32)}), (2, None)], {0: 1.0, 1: 1.0, 2: 1.0}
    )
    assert [s.finite for s in stats] == [True, False, False] and stats[0].size == 4 and stats[1].size == 0


@pytest.mark.parametrize("clock", [1e18, math.inf, math.nan])
@pytest.mark.parametrize("mode", ["diloco", "async", "streaming", "quorum", "streaming_quorum"])
def test_an_islands_clock_is_reported_never_slept_on(tmp_path, mode, clock):
    """Before: the coordinator slept until the island's own `finished_at`: 1e18 froze the
    virtual clock there (every later deadline passed at once), inf poisoned it."""
    cfg = scenario_cfg(tmp_path, mode)
    engine, _ = in_process_engine(cfg, [Fault(FaultKind.CLOCK, 2, order=n, seconds=clock) for n in (1, 3)])
    drive(engine)
    summary = engine.summary
    check_exactly_once(cfg, summary)
    assert summary["state"] == "finished" and summary["rounds_done"] == 6
    assert math.isfinite(summary["clock_seconds"]) and summary["clock_seconds"] < 200
    assert not any(e["kind"] in ("late", "crash") for e in events(cfg.out_dir))


class FullDisk:
    """The run's folders on a disk that is full while `full` is set: every append and every
    durable write raises ENOSPC, as a real full disk does (the two seams every file of a run
    is written through)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full = False
        real_append, real_write = records.append_lines, storage.durable_write

        def append(path: Path, lines: list[str]) -> None:
            self._check()
            real_append(path, lines)

        def write(path: Path, data: bytes) -> None:
            self._check()
            real_write(path, data)

        monkeypatch.setattr(records, "append_lines", append)
        monkeypatch.setattr(records, "durable_write", write)
        monkeypatch.setattr(storage, "durable_write", write)

    def _check(self) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("mode", ["diloco", "async", "quorum", "streaming_quorum"])
def test_a_disk_that_fills_mid_run_is_survived_and_checkpoints_resume(tmp_path, monkeypatch, mode):
    disk = FullDisk(monkeypatch)
    cfg = scenario_cfg(tmp_path, mode, "rounds=8", "checkpoint.every_rounds=2")
    engine, _ = in_process_engine(cfg)

    def fill(_engine) -> None:
        disk.full = True

    def free(_engine) -> None:
        assert engine.status().disk_errors > 0 and "No space left" in str(engine.status().last_disk_error)
        assert engine.outputs.checkpoint_owed  # round 4's checkpoint could not be written
        disk.full = False

    drive(engine, at={3: fill, 5: free})
    summary = engine.summary
    assert summary["state"] == "finished" and summary["rounds_done"] == 8
    check_exactly_once(cfg, summary)
    # the owed checkpoint was written at the first record after the disk freed, then on schedule
    state = load_checkpoint(engine.checkpoints)
    assert state["counters"]["rounds_done"] == 8 and not engine.outputs.checkpoint_owed
    # nothing written while the disk was full is missing from the files
    lines = (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 8
    assert len(events(cfg.out_dir)) == engine.events.count
    assert (Path(cfg.out_dir) / "summary.json").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A real 256 KiB tmpfs: a full disk as the kernel makes one (an append takes what fits
    in the file's last page, then ENOSPC). Root, as CI is; skipped elsewhere."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], check=False).returncode:
        pytest.skip("this root may not mount a tmpfs (an unprivileged container)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk: Path) -> Path:
    """Take every free byte of `disk` (a page at a time, then byte by byte)."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (4096, 1):
            try:
                while True:
                    f.write(b"x" * size)
            except OSError as err:
                assert err.errno == errno.ENOSPC
    return filler


def test_logs_on_a_real_disk_that_fills_mid_append_resume_with_every_line_whole(tmp_path, small_disk):
    """Before: ENOSPC mid-append left a partial line, the backlog was appended after it and
    `{"r{"round": 140, ...}` sat mid-file; `mend` trimmed only the tail, so the resume failed
    with `JSONDecodeError`. Now a failed append is cut back to where it began: the disk fills
    at round 2 and frees at round 4, the coordinator dies at round 5, and the resumed run
    reads every line and records every round once."""
    cfg = scenario_cfg(
        tmp_path, "diloco", "rounds=8", f"out_dir={small_disk / 'out'}", f"checkpoint.path={tmp_path / 'ckpt'}"
    )
    first, pool = in_process_engine(cfg, run_id="full")
    filled: list[Path] = []

    def free(engine) -> None:
        assert engine.status().disk_errors > 0 and "No space left" in str(engine.status().last_disk_error)
        filled.pop().unlink()

    drive(first, at={2: lambda _e: filled.append(_fill(small_disk)), 4: free}, until=5)
    pool.coordinator_lost()
    second = build_engine(cfg, pool, run_id="full")
    assert second.resumed
    drive(second)
    assert second.summary["state"] == "finished"
    out = small_disk / "out"
    rounds = [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rounds == list(range(1, 9))
    assert all(json.loads(line) for line in (out / "events.jsonl").read_text().splitlines())


def test_a_disk_still_full_at_the_end_still_returns_the_summary(tmp_path, monkeypatch):
    disk = FullDisk(monkeypatch)
    cfg = scenario_cfg(tmp_path, "diloco")
    engine, _ = in_process_engine(cfg)
    drive(engine, at={5: lambda _e: setattr(disk, "full", True)})
    assert engine.summary["state"] == "finished" and engine.summary["rounds_done"] == 6
    assert not (Path(cfg.out_dir) / "summary.json").exists() and engine.status().disk_errors >= 3


def test_an_unforeseen_error_is_a_clean_run_failed_with_the_checkpoint_intact(tmp_path, monkeypatch):
    cfg = scenario_cfg(tmp_path, "diloco")
    engine, _ = in_process_engine(cfg)
    calls = {"n": 0}
    real = engine.pacing.next_close

    def broken(*args, **kwargs):
        calls["n"] += 1
        if engine.rounds_done >= 3:
            raise ZeroDivisionError("a bug")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.pacing, "next_close", broken)
    with pytest.raises(RunFailed, match=r"round engine failed at version \d+: ZeroDivisionError: a bug"):
        engine.execute()
    assert engine.status().state == "failed"
    assert load_checkpoint(engine.checkpoints)["counters"]["rounds_done"] == 3


@pytest.mark.parametrize("mode", ["diloco", "async", "streaming", "quorum", "streaming_quorum"])
def test_a_restart_with_every_island_mid_round_at_long_h_keeps_them_all(tmp_path, mode):
    from archipelago.orchestrator.engine.build import build_engine

    cfg = scenario_cfg(tmp_path, mode, "inner_steps=40", "inner.optimizer=adamw", "round_timeout_s=100")
    first, pool = in_process_engine(cfg, run_id="busy")
    drive(first, until=2)
    while not first.flights or any(f.result is not None for f in first.flights.values()):
        first.step()  # until every island has work out and none has delivered it
    kept = {i: (island, island.optimizer, len(island.optimizer.state)) for i, island in pool.islands.items()}
    pool.coordinator_lost()
    second = build_engine(cfg, pool, run_id="busy")
    seen: dict = {}
    drive(second, at={3: lambda _e: seen.update({i: (isl, isl.optimizer) for i, isl in pool.islands.items()})})
    assert second.summary["state"] == "finished" and second.summary["rounds_done"] == 6
    assert seen == {i: k[:2] for i, k in kept.items()}
    assert all(k[2] > 0 for k in kept.values())  # the inner optimizer had state, and it is the same object
    after = [e["kind"] for e in events(cfg.out_dir)]
    after = after[after.index("restart") :]
    assert after.count("reattach") == 3 and "requested" not in after and "crash" not in after


@pytest.mark.parametrize("mode", ["diloco", "async", "overlap", "streaming", "quorum", "streaming_quorum"])
def test_seeded_chaos_trains_each_batch_once_and_ends_close_to_the_clean_run(tmp_path, mode):
    """Crashes, joins and drains drawn from a seed, in every mode (the Ray chaos test runs
    one mode on real actors; the logic it checks is the engine's, checked here in all)."""
    import random

    from archipelago.orchestrator.engine.commands import AddIslands, Drain

    clean = run_scenario(scenario_cfg(tmp_path, mode, "rounds=12", "data_shards=6"))
    rng = random.Random(1234)
    faults = [Fault(FaultKind.CRASH, rng.randrange(3), order=rng.randint(2, 6))]
    actions = {r: rng.choice(["join", "drain"]) for r in rng.sample(range(2, 10), 3)}

    def act(kind: str):
        def do(engine) -> None:
            if kind == "join":
                engine.submit(AddIslands(count=1))
            elif live := engine.members.schedulable():
                engine.submit(Drain(island=rng.choice(live)))

        return do

    cfg = scenario_cfg(tmp_path, mode, "rounds=12", "data_shards=6")
    summary = run_scenario(cfg, faults, at={r: act(k) for r, k in actions.items()})
    assert summary["state"] == "finished" and summary["rounds_done"] == 12
    assert summary["final_eval_loss"] <= clean["final_eval_loss"] * 1.25 + 0.02, (actions, summary["final_eval_loss"])
    kinds = {e["kind"] for e in events(cfg.out_dir)}
    assert "crash" in kinds and kinds & {"join", "drain"}


@pytest.mark.parametrize("mode", ["diloco", "ddp", "async", "overlap", "streaming", "quorum", "streaming_quorum"])
def test_restart_on_failure_gives_up_every_islands_work_and_stands_still(tmp_path, mode):
    """`simulation.restart_s` (the checkpoint-restart baseline): a crash costs every
    island's work in progress and `restart_s` of standing still; each batch is still
    trained exactly once and the run trains its full budget of batches."""
    clean = run_scenario(scenario_cfg(tmp_path, mode))
    cfg = scenario_cfg(tmp_path, mode, "simulation.restart_s=7")
    engine, _ = in_process_engine(cfg, [Fault(FaultKind.CRASH, island=1, order=2)])
    drive(engine)
    check_exactly_once(cfg, engine.summary)
    events = [e.as_dict() for e in engine.events.since(0)]
    restarts = [e for e in events if e["kind"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["halt_s"] == 7
    gave_up = [e for e in events if e["kind"] == "lost" and "restarts" in e["reason"]]
    assert gave_up  # the other islands' work went with it
    assert engine.summary["clock_seconds"] >= clean["clock_seconds"] + 7
    batches = sum(engine.summary["shards"]["position"])
    assert batches == sum(clean["shards"]["position"])  # the full budget, the given-up round redone


def test_an_export_that_fails_at_the_end_loses_neither_final_pt_nor_the_summary(tmp_path):
    """The export used to be written first: one that raised left no final.pt."""
    cfg = scenario_cfg(tmp_path, "diloco")
    engine, _ = in_process_engine(cfg)

    def refuse(model, out_dir):
        raise ValueError("this model cannot be saved in that format")

    engine.outputs.task.save_pretrained = refuse  # an exportable task whose library refuses
    drive(engine)
    summary = json.loads((Path(cfg.out_dir) / "summary.json").read_text())
    assert summary["state"] == "finished" and "export" not in summary
    assert summary["export_error"] == "ValueError: this model cannot be saved in that format"
    assert (Path(cfg.out_dir) / "final.pt").exists()


def test_a_step_reports_the_chain_a_crash_sets_off_under_the_restart_policy(tmp_path):
    """`step()` returns what it carried out, in order: the island lost, its release (its
    work given up), the halt, and its replacement placed while the fleet stands still —
    the chain the collaborators once ran through callbacks into the engine."""
    cfg = scenario_cfg(tmp_path, "diloco", "simulation.restart_s=7")
    engine, _ = in_process_engine(cfg, [Fault(FaultKind.CRASH, island=1, order=2)])
    engine.start()
    transitions = []
    while transition := engine.step():
        transitions.append(transition)
    chains = [t.outcomes for t in transitions if any(isinstance(o, Lost) for o in t.outcomes)]
    assert len(chains) == 1
    kinds = [type(o) for o in chains[0]]
    assert kinds[:3] == [Lost, Release, Halt] and Place in kinds[3:], kinds
    lost, release, halt = chains[0][:3]
    assert lost.island == release.island == 1 and release.state == IslandState.DEAD and halt.seconds == 7
    place = next(o for o in chains[0] if isinstance(o, Place))
    assert place.island not in (0, 1, 2)  # a new index: the dead island's is never reused
    assert transitions[0].before == RunPhase.STARTING and transitions[-1].after == RunPhase.TRAINING
    assert not transition and transition.after == RunPhase.FINISHED


@pytest.mark.parametrize("mode", ["diloco", "async"])
def test_an_unreachable_islands_work_is_lost_and_the_island_kept(tmp_path, mode):
    """Ray could not reach an island for its result (a partition: `ActorUnavailableError`):
    that work's batches go back to the ledger and the island stays — neither crashed,
    released nor replaced — and trains again; every batch is trained once."""
    from archipelago.orchestrator.engine.pool import Unreachable

    cfg = scenario_cfg(tmp_path, mode, "rounds=5")
    engine, _ = in_process_engine(cfg)
    cut: dict[str, int] = {}

    def unreachable(engine) -> None:
        while not engine.inflight.in_flight():
            engine.step()
        flight = engine.inflight.in_flight()[0]
        cut.update(island=flight.work.island, ticket=flight.ticket)
        engine._handle([Unreachable(ticket=flight.ticket, island=flight.work.island, reason="unreachable: test")])
        assert flight.ticket not in engine.inflight.flights
        assert engine.members.islands[flight.work.island].state == IslandState.TRAINING

    drive(engine, {1: unreachable})
    check_exactly_once(cfg, engine.summary)
    island = cut["island"]
    kinds = [(e["kind"], e["island"], e.get("reason")) for e in events(cfg.out_dir)]
    assert ("lost", island, "unreachable: test") in kinds
    assert not [k for k in kinds if k[0] == "crash"]
    assert len([k for k in kinds if k[0] == "requested"]) == cfg.islands.count  # no replacement
    records = [json.loads(line) for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    assert any(island in r["contributed"] for r in records if r["round"] > 2)  # it trained again


def test_an_unreachable_late_island_trains_again_instead_of_waiting_to_be_hung(tmp_path):
    """Its work was past its deadline (given up, the island `late`, waiting for a result
    that an unreachable island will not deliver): the island is training again at once, not
    released as hung `elastic.late_grace_s` later."""
    from archipelago.orchestrator.engine.pool import Unreachable

    cfg = scenario_cfg(tmp_path, "diloco", "rounds=3")
    engine, _ = in_process_engine(cfg)
    engine.start()
    while not engine.inflight.in_flight():
        engine.step()
    flight = engine.inflight.in_flight()[0]
    island, ticket = flight.work.island, flight.ticket
    flight.deadline = engine.inflight.pool.now() - 1
    list(engine.inflight.expire())
    assert ticket in engine.inflight.overdue and engine.members.islands[island].state == IslandState.LATE
    engine._handle([Unreachable(ticket=ticket, island=island, reason="unreachable: test")])
    assert ticket not in engine.inflight.overdue and engine.members.islands[island].state == IslandState.TRAINING
