"""The round engine without Ray across stops and coordinator restarts: checkpoints (graceful
and stop-now, corrupt or planted ones), what a restart keeps of the membership, and runs
started from a final model or a checkpoint folder. The other scenarios are in
test_engine.py. Every scenario checks exactly-once data: each batch the
islands read is either trained into the run once or belongs to work the engine declared
lost (and so was read again by its next owner), and Σ positions × batch tokens = tokens
trained = Σ of the islands' tokens."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from archipelago.orchestrator.bench.simulation.pool import Fault, FaultKind, InProcessPool
from archipelago.orchestrator.engine.build import build_engine
from archipelago.orchestrator.engine.commands import (
    Ack,
    AddIslands,
    Drain,
    Pause,
    Preempt,
    Refusal,
    Refused,
    Resume,
    SetTarget,
    SettingsUpdate,
    Stop,
    UpdateSettings,
)
from archipelago.orchestrator.engine.fleet import fleet as fleet_module
from archipelago.orchestrator.engine.state import membership
from archipelago.orchestrator.engine.state.checkpoints import load_checkpoint, save_checkpoint
from archipelago.orchestrator.engine.types import IslandState, RunFailed
from tests.engine_scenarios import Action, check_exactly_once, drive, run_scenario, scenario_cfg
from tests.helpers import events, in_process_engine

MODES = ["diloco", "ddp", "async", "overlap", "streaming", "quorum", "streaming_quorum", "sync_dylu"]


@pytest.mark.parametrize("mode", ["diloco", "overlap", "async", "streaming", "quorum", "streaming_quorum", "sync_dylu"])
def test_a_coordinator_restart_resumes_from_its_checkpoint(tmp_path, mode):
    cfg = scenario_cfg(tmp_path, mode)
    first, pool = in_process_engine(cfg, run_id="restart")

    drive(first, until=3)
    saved = load_checkpoint(Path(cfg.checkpoint_dir) / "restart")["ledger"]["position"]
    # everything read since the checkpoint (work out, and results closed after it) is redone
    lost = Counter((s, i) for s, p in enumerate(first.ledger.position) for i in range(saved[s], p))
    pool.coordinator_lost()
    second = build_engine(cfg, pool, run_id="restart")  # what the restarted coordinator does
    assert second.resumed and second.rounds_done == 3
    drive(second)
    check_exactly_once(cfg, second.summary, lost)
    assert second.summary["rounds_done"] == 6
    assert any(e["kind"] == "reattach" for e in events(cfg.out_dir)) and any(
        e["kind"] == "restart" for e in events(cfg.out_dir)
    )


@pytest.mark.parametrize("mode", ["diloco", "async", "quorum", "streaming"])
def test_settings_changed_mid_run_survive_a_coordinator_restart(tmp_path, mode):
    """H, the outer lr and the quorum rule's settings changed after round 1; the coordinator
    dies after round 3 and a new one starts from the config file as it was (a fresh copy,
    as a restarted actor reads it). Before: the outer lr came back with the optimizer's
    state, but H reverted to the config's: the change lived in the validated config object,
    which a restart reads anew."""
    cfg = scenario_cfg(tmp_path, mode, "rounds=8", "checkpoint.every_rounds=2", "elastic.placement_timeout_s=5")
    as_filed = cfg.model_copy(deep=True)
    quorum = {"quorum": 2, "grace_k": 1.5} if mode == "quorum" else {}
    change = UpdateSettings(settings=SettingsUpdate(inner_steps=8, outer_lr=0.3, **quorum))
    first, pool = in_process_engine(cfg, run_id="settings")
    drive(first, at={1: lambda e: e.submit(change)}, until=3)
    pool.coordinator_lost()
    second = build_engine(as_filed, pool, run_id="settings")
    status = second.status()
    assert second.resumed and second.rounds_done == 2
    assert (status.inner_steps, status.outer_lr) == (8, 0.3) and as_filed.inner_steps == 4
    assert {k: getattr(status, k) for k in quorum} == quorum
    drive(second)
    assert second.summary["inner_steps"] == 8 and second.summary["rounds_done"] == 8


def test_a_resume_with_a_new_h_in_its_config_takes_the_configs(tmp_path):
    """The checkpoint's settings are an operator's changes to the same config: a resume
    whose config file sets another H (a deliberate change) runs with the file's."""
    cfg = scenario_cfg(tmp_path, "diloco", "rounds=8", "checkpoint.every_rounds=2", "elastic.placement_timeout_s=5")
    first, pool = in_process_engine(cfg, run_id="newh")
    drive(first, until=3)
    pool.coordinator_lost()
    second = build_engine(cfg.model_copy(update={"inner_steps": 8}), pool, run_id="newh")
    assert second.resumed and second.status().inner_steps == 8


def test_a_graceful_stop_finishes_the_round_and_checkpoints(tmp_path):
    cfg = scenario_cfg(tmp_path, "overlap")
    summary = run_scenario(cfg, at={2: lambda e: e.submit(Stop())})
    assert summary["state"] == "stopped" and 2 <= summary["rounds_done"] < 6
    assert list((Path(cfg.checkpoint_dir) / "local").glob("state-*.pt"))


@pytest.mark.parametrize("mode", MODES)
def test_a_stop_now_checkpoints_every_step_taken_with_its_record(tmp_path, mode):

    cfg = scenario_cfg(tmp_path, mode)
    engine, _ = in_process_engine(cfg)
    engine.start()
    while engine.step():
        # a step closed and its record not yet written (barrier, lag), or mid-run (async,
        # whose records are written as soon as they are due)
        if engine.run.version >= 3 and (engine.due or mode in ("async", "quorum")):
            engine.submit(Stop(now=True))
    summary, state = engine.summary, load_checkpoint(engine.checkpoints)
    assert summary["state"] == "stopped" and state["counters"]["rounds_done"] == summary["rounds_done"] >= 1
    assert state["version"] == summary["outer_steps"]
    check_exactly_once(cfg, summary)


def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(tmp_path):

    cfg = scenario_cfg(tmp_path, "diloco", "checkpoint.keep=2")
    first, pool = in_process_engine(cfg, run_id="corrupt")
    drive(first, until=4)
    saved = sorted(Path(str(first.checkpoints)).glob("state-*.pt"))
    assert [p.name for p in saved] == ["state-000003.pt", "state-000004.pt"]  # the newest 2 kept
    data = bytearray(saved[-1].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the newest
    saved[-1].write_bytes(bytes(data))
    assert load_checkpoint(first.checkpoints)["counters"]["rounds_done"] == 3
    pool.coordinator_lost()
    second = build_engine(cfg, pool, run_id="corrupt")
    assert second.resumed and second.rounds_done == 3
    drive(second)
    assert second.summary["rounds_done"] == 6 and second.summary["state"] == "finished"


def test_a_planted_checkpoint_cannot_run_code(tmp_path):
    """Before: `torch.load(weights_only=False)`: anyone who could write the checkpoint volume
    could run code in the coordinator (a matching checksum does not help: they write both)."""
    import hashlib
    import io
    import pickle

    from archipelago.orchestrator.engine.state.checkpoints import CheckpointError, load_checkpoint

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    folder = tmp_path / "ckpt"
    folder.mkdir()
    buffer = io.BytesIO()
    torch_save = __import__("torch").save
    torch_save({"run_id": "x", "evil": Payload()}, buffer, pickle_module=pickle)
    (folder / "state-000001.pt").write_bytes(buffer.getvalue())
    (folder / "state-000001.pt.sha256").write_text(hashlib.sha256(buffer.getvalue()).hexdigest())
    with pytest.raises(CheckpointError, match=r"state-000001\.pt"):
        load_checkpoint(folder)
    assert not marker.exists()


def test_a_checkpoint_naming_files_outside_its_folder_is_refused_and_nothing_there_is_touched(tmp_path):
    """Before: island-state names read from a checkpoint were used as paths, so a state named
    `../../victim.txt` was deleted once superseded. Whoever can write the volume can write a
    matching digest too: the names themselves are checked, the resume refused (exit 2), and
    no file outside the folder is read, written or deleted."""
    import hashlib

    import torch

    from archipelago.orchestrator.cli import main
    from archipelago.orchestrator.engine.state.checkpoints import UnsafeCheckpoint
    from archipelago.workers.runtime.storage import Folder, UnsafeName

    cfg = scenario_cfg(tmp_path, "diloco", "inner.optimizer=adamw", "checkpoint.every_rounds=2")
    engine, pool = in_process_engine(cfg, run_id="crafted")
    drive(engine, until=4)
    pool.close()
    folder = Path(str(engine.checkpoints))
    victims = [tmp_path / "victim.txt", tmp_path / "absolute.txt"]
    for victim in victims:
        victim.write_text("keep me")
    newest = sorted(folder.glob("state-*.pt"))[-1]
    state = torch.load(newest, weights_only=True)
    assert state["island_states"]  # the run kept its islands' states: the names a resume uses
    state["island_states"].append("../../../victim.txt")
    member = next(iter(state["membership"]["members"].values()))
    member["inner_state"] = str(victims[1])
    torch.save(state, newest)
    (folder / f"{newest.name}.sha256").write_text(hashlib.sha256(newest.read_bytes()).hexdigest())

    with pytest.raises(UnsafeCheckpoint, match=r"victim\.txt"):
        load_checkpoint(folder)  # refused outright: not the checkpoint before it
    assert main(["-q", "run", "--resume", cfg.out_dir]) == 2
    with pytest.raises(UnsafeCheckpoint):
        build_engine(cfg, InProcessPool(cfg), run_id="crafted")
    assert all(v.read_text() == "keep me" for v in victims)
    for name in ("../x", "/etc/passwd", "a/b", "..", ""):
        with pytest.raises(UnsafeName):
            Folder(folder).delete(name)


def _restart_after(tmp_path, mode: str, change: Action, crash_at: int, *extra: str):
    """Checkpoints every 2 rounds; `change` right after round 2's; the coordinator dies at
    `crash_at` (after the change took effect, before the next checkpoint) and a new one
    resumes. Returns (config, the engine before, the resumed engine's summary)."""

    cfg = scenario_cfg(tmp_path, mode, "rounds=8", "checkpoint.every_rounds=2", "elastic.placement_timeout_s=5", *extra)
    first, pool = in_process_engine(cfg, run_id="intent")
    drive(first, at={2: change}, until=crash_at)
    saved = load_checkpoint(Path(cfg.checkpoint_dir) / "intent")["ledger"]["position"]
    # everything read since the checkpoint is redone by the restarted coordinator
    lost = Counter((s, i) for s, p in enumerate(first.ledger.position) for i in range(saved[s], p))
    pool.coordinator_lost()
    second = build_engine(cfg, pool, run_id="intent")
    assert second.resumed and second.rounds_done == 2
    drive(second)
    check_exactly_once(cfg, second.summary, lost)
    return cfg, first, second


@pytest.mark.parametrize("mode", ["diloco", "async", "quorum", "streaming_quorum"])
def test_an_island_added_after_the_checkpoint_is_adopted_on_restart(tmp_path, mode):
    """Before: the restarted coordinator restored the checkpoint's target and membership;
    an island that joined since was orphaned (still holding its resources) and a later
    join could collide with its name."""
    cfg, first, second = _restart_after(tmp_path, mode, lambda e: e.submit(AddIslands(count=1)), crash_at=3)
    assert first.members.islands[3].state.value == "training"  # it had joined before the crash
    summary = second.summary
    assert second.members.target == 4 and set(summary["islands"]) == {"0", "1", "2", "3"}
    assert summary["islands"]["3"]["state"] == "training" and summary["islands"]["3"]["rounds_contributed"] >= 1
    assert any(e["kind"] == "reattach" and e["island"] == 3 for e in events(cfg.out_dir))


@pytest.mark.parametrize("mode", ["diloco", "async", "quorum", "streaming_quorum"])
def test_a_drained_island_stays_drained_across_a_restart(tmp_path, mode):
    _, first, second = _restart_after(tmp_path, mode, lambda e: e.submit(Drain(island=1)), crash_at=3)
    assert first.members.islands[1].state.value == "drained"
    summary = second.summary
    assert summary["islands"]["1"]["state"] == "drained" and second.members.target == 2
    assert set(summary["islands"]) == {"0", "1", "2"}  # not replaced, not relaunched


def test_a_draining_island_goes_on_draining_across_a_restart(tmp_path):
    slow = "simulation.slowdown=[1.0,10.0,1.0]"  # island 1's round is still out at the crash
    _, first, second = _restart_after(
        tmp_path, "async", lambda e: e.submit(Drain(island=1)), 3, slow, "round_timeout_s=100"
    )
    assert first.members.islands[1].state.value == "draining"
    summary = second.summary
    assert summary["islands"]["1"]["state"] == "drained" and second.members.target == 2
    assert set(summary["islands"]) == {"0", "1", "2"}


def test_a_lowered_target_holds_across_a_restart(tmp_path):
    _, _, second = _restart_after(tmp_path, "diloco", lambda e: e.submit(SetTarget(islands=2)), crash_at=3)
    summary = second.summary
    assert second.members.target == 2 and sum(s["state"] == "training" for s in summary["islands"].values()) == 2


@pytest.mark.parametrize("source", ["final", "checkpoint"])
def test_a_run_starts_from_a_final_model_or_a_checkpoint_folder(tmp_path, source):
    """`init_from` (`archipelago run --init-from`): the new run's first evaluation is the
    earlier run's last, and summary.json says where its weights came from."""
    first = run_scenario(scenario_cfg(tmp_path, "diloco"))
    path = Path(first["out_dir"]) / "final.pt" if source == "final" else Path(first["out_dir"]) / "checkpoint"
    second = run_scenario(scenario_cfg(tmp_path, "diloco", f"init_from={path}"))
    assert second["initial_eval_loss"] == pytest.approx(first["final_eval_loss"], rel=1e-9)
    assert second["init_from"]["kind"] == source and second["init_from"]["path"] == str(path.resolve())
    assert len(second["init_from"]["sha256"]) == 64 and first["init_from"] is None
    assert second["rounds_done"] == 6 and np.isfinite(second["final_eval_loss"])


def test_init_from_refuses_what_does_not_fit(tmp_path):
    from archipelago.orchestrator.config_load import ConfigError

    with pytest.raises(ConfigError, match="init_from"):
        scenario_cfg(tmp_path, "diloco", f"init_from={tmp_path / 'missing.pt'}")
    import torch

    wrong = tmp_path / "wrong.pt"
    torch.save({"x": torch.zeros(7, dtype=torch.float64)}, wrong)  # the toy model has 2 parameters
    with pytest.raises(RunFailed, match="does not fit"):
        in_process_engine(scenario_cfg(tmp_path, "diloco", f"init_from={wrong}"))
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a model")
    with pytest.raises(RunFailed, match="not a model state_dict"):
        in_process_engine(scenario_cfg(tmp_path, "diloco", f"init_from={garbage}"))


def test_a_restart_before_the_first_checkpoint_releases_the_islands_it_replaces(tmp_path):
    """Found on a multi-node cluster: a coordinator restarted with no checkpoint yet started
    afresh and asked for islands under names its predecessor's islands still held."""
    cfg = scenario_cfg(tmp_path, "diloco", "checkpoint.every_rounds=0")
    first, pool = in_process_engine(cfg, run_id="early")
    drive(first, until=2)
    pool.coordinator_lost()
    second = build_engine(cfg, pool, run_id="early")
    assert not second.resumed
    drive(second)
    assert second.summary["rounds_done"] == 6 and second.summary["state"] == "finished"


def test_two_runs_on_one_checkpoint_folder_keep_apart_and_each_resumes_its_own(tmp_path):
    """Each run checkpoints under its own id. Before, a second run on a shared folder
    numbered its files after the first run's and pruned them (seen live: 3 of 5 gone),
    and a restart loaded whichever run's file was newest, silently starting over when
    the run id did not match."""
    shared = tmp_path / "shared"
    a = scenario_cfg(tmp_path, "diloco", f"checkpoint.path={shared}", "checkpoint.keep=2")
    b = scenario_cfg(tmp_path, "diloco", f"checkpoint.path={shared}", "checkpoint.keep=2", "seed=1")
    first, pool = in_process_engine(a, run_id="first")
    drive(first, until=3)
    kept = {p.relative_to(shared): p.read_bytes() for p in (shared / "first").rglob("*") if p.is_file()}
    second, _ = in_process_engine(b, run_id="second")
    assert not second.resumed
    drive(second)
    assert second.summary["rounds_done"] == 6
    assert {p.relative_to(shared): p.read_bytes() for p in (shared / "first").rglob("*") if p.is_file()} == kept
    assert sorted(p.name for p in (shared / "second").glob("state-*.pt")) == ["state-000005.pt", "state-000006.pt"]
    pool.coordinator_lost()
    again = build_engine(a, pool, run_id="first")
    assert again.resumed and again.rounds_done == 3
    drive(again)
    assert again.summary["rounds_done"] == 6


def test_resume_continues_the_run_its_outputs_name_and_refuses_a_guess(tmp_path):
    from archipelago.orchestrator.cli import main
    from archipelago.orchestrator.config_load import dump_config
    from archipelago.orchestrator.runtime.driver import ResumeRefused, resume_id

    shared = tmp_path / "shared"
    cfgs = {
        rid: scenario_cfg(tmp_path, "diloco", f"checkpoint.path={shared}", "rounds=2") for rid in ("first", "second")
    }
    for rid, cfg in cfgs.items():
        drive(in_process_engine(cfg, run_id=rid)[0])
    assert [resume_id(cfg) for cfg in cfgs.values()] == ["first", "second"]
    # config.yaml sits on a writable volume and names code to import: only the checkpoint's own factory
    second = cfgs["second"]
    planted = second.model_copy(update={"task": second.task.model_copy(update={"factory": "os:system"})})
    with pytest.raises(ResumeRefused, match=r"'os:system' .* trained with 'tests\.toy_tasks:make_recording'"):
        resume_id(planted)
    marker = tmp_path / "planted-code-ran"
    config = Path(second.out_dir) / "config.yaml"
    kept = config.read_text()
    task = second.task.model_copy(update={"factory": "tests.toy_tasks:make_planted", "kwargs": {"marker": str(marker)}})
    config.write_text(dump_config(second.model_copy(update={"task": task})))
    assert main(["run", "--resume", second.out_dir]) == 2 and not marker.exists()  # refused, never imported
    config.write_text(kept)
    (Path(cfgs["first"].out_dir) / "run_id").unlink()  # outputs that name no run: which of two?
    with pytest.raises(ResumeRefused, match="runs second, first"):
        resume_id(cfgs["first"])
    lone = scenario_cfg(tmp_path, "diloco", f"checkpoint.path={tmp_path / 'empty'}")
    (Path(lone.out_dir)).mkdir(parents=True)
    (Path(lone.out_dir) / "config.yaml").write_text(dump_config(lone))
    (Path(lone.out_dir) / "run_id").write_text("gone")
    with pytest.raises(ResumeRefused, match="no checkpoint of run gone"):
        resume_id(lone)
    assert main(["run", "--resume", lone.out_dir]) == 2  # before anything starts
    (Path(lone.out_dir) / "run_id").unlink()
    with pytest.raises(ResumeRefused, match="holds no checkpoint"):
        resume_id(lone)


def test_a_named_run_continues_its_checkpoints_the_way_a_retried_job_does(tmp_path):
    """`archipelago run --run-id ID` (a RayJob's entrypoint, retried after a failure):
    checkpoints of ID in checkpoint.path mean continue, none mean start under that id."""
    from archipelago.orchestrator.cli import main
    from archipelago.orchestrator.runtime.driver import ResumeRefused, check_resumable

    cfg = scenario_cfg(tmp_path, "diloco", "rounds=2")
    assert not check_resumable(cfg, "retried")  # first attempt: starts afresh
    drive(in_process_engine(cfg, run_id="retried")[0])
    assert check_resumable(cfg, "retried")  # the retry: continues it
    retry = build_engine(cfg.model_copy(update={"rounds": 4}), InProcessPool(cfg), run_id="retried")
    assert retry.resumed and retry.rounds_done == 2
    other = cfg.model_copy(update={"task": cfg.task.model_copy(update={"factory": "tests.toy_tasks:make_quadratic"})})
    with pytest.raises(ResumeRefused, match=r"trained with 'tests\.toy_tasks:make_recording'"):
        check_resumable(other, "retried")
    with pytest.raises(ResumeRefused, match="cannot name a folder"):
        check_resumable(cfg, "../elsewhere")
    assert main(["run", "--resume", str(tmp_path), "--run-id", "retried"]) == 2


def test_a_resume_from_a_chosen_checkpoint_continues_that_branch_through_restarts(tmp_path):
    """`--resume DIR@N`: from checkpoint N, not the newest; the later ones stay, the run's
    new checkpoints are tagged with N, so a coordinator restart continues the branch."""
    from archipelago.orchestrator.cli import main

    cfg = scenario_cfg(tmp_path, "diloco", "checkpoint.keep=20")
    first, pool = in_process_engine(cfg, run_id="branching")
    drive(first)  # checkpoints 1..6
    chosen = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume_from": 3})})
    second = build_engine(chosen, pool, run_id="branching")
    assert second.resumed and second.rounds_done == 3
    drive(second, until=4)  # saves state-7 on the branch
    pool.coordinator_lost()
    third = build_engine(chosen, pool, run_id="branching")  # a restart mid-branch: not back to 3
    assert third.rounds_done == 4
    drive(third)
    assert third.summary["rounds_done"] == 6
    records = [json.loads(line)["round"] for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    assert records == [1, 2, 3, 4, 5, 6]  # the log rewound to checkpoint 3, then the branch's rounds
    assert main(["run", "--resume", f"{cfg.out_dir}@99", "--set", "rounds=6"]) == 2  # no checkpoint 99


def test_a_planted_membership_intent_is_held_to_the_configs_bounds(tmp_path):
    """The intent journal is on a writable volume: a target of 1,000,000 used to ask for a
    million placement groups."""
    import json

    cfg = scenario_cfg(tmp_path, "diloco", "checkpoint.every_rounds=2", "elastic.max_islands=4")
    first, pool = in_process_engine(cfg, run_id="planted")
    drive(first, until=3)
    intent = Path(str(first.checkpoints)) / "membership.json"
    intent.write_text(json.dumps({"run_id": "planted", "target": 10**6, "leaving": ["0", True, 2.5]}))
    pool.coordinator_lost()
    second = build_engine(cfg, pool, run_id="planted")
    drive(second)
    assert second.members.target == 4 and second.summary["rounds_done"] == 6
    assert not any(s["state"] in ("draining", "drained") for s in second.summary["islands"].values())


def test_long_released_islands_fold_into_totals_that_a_restart_keeps(tmp_path, monkeypatch):
    """A run that keeps replacing dead islands lists only the newest released ones (2 here,
    64 shipped); the rest are totals that still add up, survive a coordinator restart,
    and whose indexes are never handed out again."""
    monkeypatch.setattr(membership, "RETAINED", 2)
    cfg = scenario_cfg(tmp_path, "diloco", "rounds=16")
    chain = (0, *range(3, 12))  # island 0 dies at its 2nd work order, then each replacement at its 2nd
    first, pool = in_process_engine(cfg, [Fault(FaultKind.CRASH, i, order=2) for i in chain], run_id="prune")
    drive(first, until=8)
    gone = [i for i, s in first.members.islands.items() if s.state.gone]
    assert len(gone) == 2 and first.members.retired.islands >= 2
    assert first.members.retired.last_index < min(gone)
    saved_at = load_checkpoint(Path(cfg.checkpoint_dir) / "prune")["ledger"]["position"]
    lost = Counter((s, i) for s, p in enumerate(first.ledger.position) for i in range(saved_at[s], p))
    pool.coordinator_lost()
    second = build_engine(cfg, pool, run_id="prune")
    saved = second.members.retired.islands
    assert saved >= 2 and second.members.retired.tokens > 0
    drive(second)
    summary = second.summary
    replaced = summary["retired_islands"]["islands"] + sum(
        1 for s in summary["islands"].values() if IslandState(s["state"]).gone
    )
    assert max(int(i) for i in summary["islands"]) == 2 + replaced  # 3 islands, then one index per replacement
    assert summary["retired_islands"]["islands"] > saved
    check_exactly_once(cfg, summary, lost)


@pytest.mark.parametrize("mode", ["diloco", "async"])
@pytest.mark.parametrize(
    ("change", "target"),
    [(AddIslands(count=1), 4), (Drain(island=1), 2), (SetTarget(islands=2), 2)],
    ids=["add", "drain", "target"],
)
def test_a_change_accepted_just_before_the_coordinator_dies_holds(tmp_path, mode, change, target):
    """Accepted (the API's 202) is durable: the coordinator may die before its engine takes
    the command. Before, an add or a drain accepted in that window was lost with the
    process (the chaos run saw the target come back one island too high)."""
    cfg = scenario_cfg(tmp_path, mode, "rounds=6", "checkpoint.every_rounds=2", "elastic.placement_timeout_s=5")
    first, pool = in_process_engine(cfg, run_id="window")
    drive(first, until=2)
    assert isinstance(first.submit(change), Ack)
    pool.coordinator_lost()  # before the engine's next step
    second = build_engine(cfg, pool, run_id="window")
    drive(second)
    assert second.members.target == target
    if isinstance(change, Drain):
        assert second.summary["islands"]["1"]["state"] == "drained"


def test_a_command_sent_to_a_restarted_coordinator_before_it_reread_the_intent_waits_for_it(tmp_path):
    """A drain accepted after the newest checkpoint, then the coordinator dies; the restarted
    one is asked to pause before its fleet has read the membership intent. That pause used to
    journal the checkpoint's older membership over the intent (target one higher, no island
    leaving): the drain was lost and its island placed again (the REST chaos run, CI at ed1b1cb).
    Now it is refused as not yet durable (409: retry), and once started the drain holds."""
    cfg = scenario_cfg(tmp_path, "diloco", "rounds=6", "checkpoint.every_rounds=2", "elastic.placement_timeout_s=5")
    first, pool = in_process_engine(cfg, run_id="reread")
    drive(first, until=2)
    assert isinstance(first.submit(Drain(island=1)), Ack)
    pool.coordinator_lost()
    second = build_engine(cfg, pool, run_id="reread")
    early = second.submit(Pause())
    assert isinstance(early, Refused) and early.reason == Refusal.NOT_NOW and "restarting" in early.message
    intent = json.loads((Path(str(second.checkpoints)) / "membership.json").read_text())
    assert intent["target"] == 2 and intent["leaving"] == [1]  # untouched
    second.start()
    assert isinstance(second.submit(Pause()), Ack) and isinstance(second.submit(Resume()), Ack)
    while second.step():  # not `drive`, which starts the engine again (a second re-read)
        pass
    assert second.members.target == 2 and second.summary["islands"]["1"]["state"] == "drained"
    intent = json.loads((Path(str(second.checkpoints)) / "membership.json").read_text())
    assert intent["target"] == 2 and intent["leaving"] == [1]


def test_a_change_that_cannot_be_made_durable_is_refused_and_a_second_drain_too(tmp_path, monkeypatch):
    """No acknowledgement without the intent written: a full or read-only disk refuses the
    change (409: nothing changed, retry) rather than accept one a restart would lose; an
    island asked to leave twice before the engine took the first is refused the second time
    (it would have lowered the target twice for one island)."""
    cfg = scenario_cfg(tmp_path, "diloco", "rounds=4", "checkpoint.every_rounds=2")
    engine, _ = in_process_engine(cfg, run_id="durable")
    drive(engine, until=1)

    def full(*_):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(fleet_module, "save_intent", full)
        refused = engine.submit(AddIslands(count=1))
        assert isinstance(refused, Refused) and refused.reason == Refusal.NOT_NOW
        assert "membership intent" in refused.message and engine.inbox.requested == 3
        assert engine.inbox.queued() == (None, set())
    assert isinstance(engine.submit(Drain(island=1)), Ack)
    second = engine.submit(Drain(island=1))
    assert isinstance(second, Refused) and "already asked to leave" in second.message
    intent = json.loads((Path(str(engine.checkpoints)) / "membership.json").read_text())
    assert intent["target"] == 2 and intent["leaving"] == [1]
    drive(engine)
    assert engine.members.target == 2 and engine.summary["islands"]["1"]["state"] == "drained"


def test_a_drain_whose_island_failed_before_the_engine_took_it_still_lowers_the_target(tmp_path):
    """The 202 said one island fewer: an island that dies between the drain's acceptance
    and the engine taking it is not replaced (before, the drain found it gone and did
    nothing, so a replacement came back in its place and the target stayed)."""
    cfg = scenario_cfg(tmp_path, "diloco", "rounds=4", "checkpoint.every_rounds=2")
    engine, _ = in_process_engine(cfg, run_id="gone")
    answers = []

    def drain_then_die(e):  # round 2 closed; round 3's work not handed out yet
        answers.append(e.submit(Drain(island=1)))
        e.fleet.released(1, IslandState.DEAD, "its node died")  # what the engine does with a crash

    drive(engine, at={2: drain_then_die})
    assert isinstance(answers[0], Ack)
    assert engine.members.target == 2 and set(engine.summary["islands"]) == {"0", "1", "2"}
    assert engine.summary["islands"]["1"]["state"] == "dead" and engine.summary["rounds_done"] == 4


def _killed_mid_checkpoint(folder: Path) -> Path:
    """A writer SIGKILLed while it streams a checkpoint into `folder`: a child process opens
    the checkpoint's temporary file the way `save_checkpoint` does, writes 1 MiB and waits;
    it is killed there. Returns the temporary file it left."""
    import os
    import signal
    import subprocess
    import sys
    import time

    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from archipelago.workers.runtime.storage import Folder\n"
            f"with Folder({str(folder)!r}).open_write('state-000099.pt') as f:\n"
            "    f.write(b'x' * (1 << 20)); f.flush(); print('writing', flush=True); time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "writing"
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    deadline = time.time() + 10
    while not (left := list(folder.glob(".state-000099.pt.*.tmp"))) and time.time() < deadline:
        time.sleep(0.05)
    assert len(left) == 1 and left[0].stat().st_size == 1 << 20
    return left[0]


@pytest.mark.parametrize("mode", ["diloco", "async"])
def test_a_run_killed_mid_append_and_mid_checkpoint_resumes_and_leaves_no_temporary_file(tmp_path, mode):
    """A kill mid-append leaves a torn last line in `metrics.jsonl` and `events.jsonl`
    (the resumed coordinator failed on it with `JSONDecodeError`); a kill mid-checkpoint a
    state-sized temporary file nothing removed. The restart cuts the torn lines (every line
    left parses, each round recorded once), removes the orphan, and finishes with
    exactly-once data."""
    cfg = scenario_cfg(tmp_path, mode)
    first, pool = in_process_engine(cfg, run_id="torn")
    drive(first, until=3)
    saved = load_checkpoint(Path(cfg.checkpoint_dir) / "torn")["ledger"]["position"]
    lost = Counter((s, i) for s, p in enumerate(first.ledger.position) for i in range(saved[s], p))
    out = Path(cfg.out_dir)
    for name in ("metrics.jsonl", "events.jsonl"):
        with open(out / name, "ab") as f:
            f.write(b'{"round": 4, "eval_loss": 2.1')  # the append the kill cut short
    orphan = _killed_mid_checkpoint(Path(str(first.checkpoints)))
    pool.coordinator_lost()
    second = build_engine(cfg, pool, run_id="torn")
    assert second.resumed and second.rounds_done == 3
    assert not orphan.exists() and not list(Path(str(first.checkpoints)).glob("*.tmp"))
    drive(second)
    check_exactly_once(cfg, second.summary, lost)
    rounds = [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rounds == sorted(set(rounds)) and rounds[-1] == second.summary["rounds_done"] == 6
    assert all(json.loads(line) for line in (out / "events.jsonl").read_text().splitlines())
    assert not list(Path(str(first.checkpoints)).glob("*.tmp"))


def test_a_command_retried_with_its_key_across_a_restart_is_applied_once(tmp_path):
    """A client whose `AddIslands` got no answer (the coordinator died) sends it again with
    the same idempotency key: the key was journalled with the change, so the restarted
    coordinator answers it with the first answer and the target rises once. A preemption
    accepted and not yet taken is journalled too: after the restart its island is leaving."""
    cfg = scenario_cfg(tmp_path, "diloco", "rounds=8", "checkpoint.every_rounds=2", "elastic.placement_timeout_s=5")
    first, pool = in_process_engine(cfg, run_id="keys")
    drive(first, until=2)
    ack = first.submit(AddIslands(count=1), key="add-7f3a")
    assert isinstance(ack, Ack) and ack.detail == {"target": 4}
    assert first.submit(AddIslands(count=1), key="add-7f3a") == ack  # the same answer, nothing applied again
    refused = first.submit(SetTarget(islands=5), key="add-7f3a")
    assert isinstance(refused, Refused) and refused.reason == Refusal.INVALID and "another command" in refused.message
    assert isinstance(first.submit(Preempt(island=1), key="preempt-1"), Ack)
    pool.coordinator_lost()  # before the engine took either
    second = build_engine(cfg, pool, run_id="keys")
    second.start()
    assert second.submit(AddIslands(count=1), key="add-7f3a") == ack
    assert second.members.target == 4 and second.inbox.requested == 4
    assert second.members.islands[1].state.value == "draining"  # the preemption survived the restart
    assert isinstance(second.submit(AddIslands(count=1), key="add-other"), Ack) and second.inbox.requested == 5


def test_settings_and_a_pause_accepted_before_a_crash_hold_after_the_restart(tmp_path):
    """A 202 means the change survives the coordinator: a settings change and a pause the
    engine had not taken yet when the coordinator died were lost (the REST chaos test's
    settings change, acknowledged and then killed with the coordinator). They are journalled
    with the membership intent and taken again by the restarted coordinator; a resume with
    another config keeps the config's values."""
    cfg = scenario_cfg(tmp_path, "diloco", "rounds=8", "checkpoint.every_rounds=2")
    first, pool = in_process_engine(cfg, run_id="journal")
    drive(first, until=2)
    assert isinstance(first.submit(UpdateSettings(settings=SettingsUpdate(outer_lr=0.35, inner_steps=3))), Ack)
    assert isinstance(first.submit(Pause()), Ack)
    pool.coordinator_lost()  # before the engine took either
    second = build_engine(cfg, pool, run_id="journal")
    second.start()
    assert second.inbox.paused.is_set()  # paused as the operator left it
    second.submit(Resume())
    drive(second, until=3)  # the next boundary: the journalled settings are taken
    assert second.status().inner_steps == 3 and second.status().outer_lr == 0.35
    drive(second)
    assert second.summary["state"] == "finished"
    pool.coordinator_lost()
    other = scenario_cfg(tmp_path, "diloco", "rounds=10", "inner_steps=5", "checkpoint.every_rounds=2")
    other = other.model_copy(update={"out_dir": cfg.out_dir, "checkpoint": cfg.checkpoint})
    third = build_engine(other, pool, run_id="journal")  # `--resume` with another config
    third.start()
    third.step()
    assert third.status().inner_steps == 5 and not third.inbox.paused.is_set()


def test_a_checkpoint_in_the_earlier_layout_resumes_as_one_in_this_layout_does(tmp_path):
    """Layout 1 (before each part of the engine was saved under its own key by its own
    `state_dict()`) kept the membership's entries at the top level: a run resumes from it
    with the same islands, target and data as from the layout it is rewritten from."""
    cfg = scenario_cfg(tmp_path, "diloco")
    first, pool = in_process_engine(cfg, run_id="layout")
    first.submit(SetTarget(islands=2))
    drive(first, until=3)
    folder = Path(cfg.checkpoint_dir) / "layout"
    state = load_checkpoint(folder)
    assert state is not None and state["format"] == 2 and state["membership"]["target"] == 2
    earlier = {k: v for k, v in state.items() if k not in ("format", "membership")} | state["membership"]
    save_checkpoint(folder, earlier)  # the newest checkpoint, in layout 1
    saved = state["ledger"]["position"]
    lost = Counter((s, i) for s, p in enumerate(first.ledger.position) for i in range(saved[s], p))
    pool.coordinator_lost()
    second = build_engine(cfg, pool, run_id="layout")
    assert second.resumed and second.rounds_done == 3 and second.members.target == 2
    assert {i: s.state for i, s in second.members.islands.items()} == {
        i: IslandState(m["state"]) for i, m in state["membership"]["members"].items()
    }
    drive(second)
    check_exactly_once(cfg, second.summary, lost)
    assert second.summary["rounds_done"] == 6


def test_a_checkpoint_whose_config_has_the_earlier_mode_sections_resumes_with_its_live_settings(tmp_path):
    """A checkpoint written before the mode's settings moved into `mode` saved its config
    with the mode as a name and its settings in `asynchronous`: a run resumes from it with
    the same mode, and the quorum an operator changed mid-run holds, as from this layout."""
    cfg = scenario_cfg(tmp_path, "quorum", "rounds=8", "checkpoint.every_rounds=2")
    first, pool = in_process_engine(cfg, run_id="sections")
    change = UpdateSettings(settings=SettingsUpdate(quorum=2, grace_k=1.5))
    drive(first, at={1: lambda e: e.submit(change)}, until=3)
    folder = Path(cfg.checkpoint_dir) / "sections"
    state = load_checkpoint(folder)
    assert state is not None and state["settings"]["quorum"]["quorum"] == 2
    mode = dict(state["config"]["mode"])
    earlier = {**state["config"], "mode": mode.pop("name"), "asynchronous": mode}
    earlier["asynchronous"]["speed_smoothing"] = earlier.pop("speed_smoothing")
    save_checkpoint(folder, {**state, "config": earlier})  # the newest checkpoint, its config as saved before
    pool.coordinator_lost()
    second = build_engine(cfg, pool, run_id="sections")
    assert second.resumed and second.rounds_done == 2
    assert second.quorum is not None and (second.quorum.quorum, second.quorum.grace_k) == (2, 1.5)
    drive(second)
    assert second.summary["rounds_done"] == 8


def test_a_deep_sweep_removes_only_writers_temporaries_anywhere_below_and_never_through_a_link(tmp_path):
    """`Folder.sweep(deep=True)` (the coordinator's, over the run's folder and `islands/`):
    the temporaries `open_write` names, in the folder and below; not a file named otherwise,
    not a link named like one, nothing behind a linked folder."""
    from archipelago.workers.runtime.storage import Folder

    run, outside = tmp_path / "run", tmp_path / "outside"
    (run / "islands").mkdir(parents=True)
    outside.mkdir()
    debris = [run / ".state-000003.pt.4242.cafe0123.tmp", run / "islands" / ".island-00001-ab.npz.77.deadbeef.tmp"]
    kept = [
        run / "islands" / "island-00001-ab.npz",
        run / "notes.tmp",
        run / ".x.tmp",
        outside / ".v.npz.1.0123abcd.tmp",
    ]
    for path in [*debris, *kept]:
        path.write_bytes(b"x")
    (run / ".link.npz.5.0123abcd.tmp").symlink_to(outside / ".v.npz.1.0123abcd.tmp")
    (run / "linked").symlink_to(outside, target_is_directory=True)
    removed = Folder(str(run)).sweep(deep=True)
    assert sorted(removed) == sorted(str(p.relative_to(run)) for p in debris)
    assert not any(p.exists() for p in debris) and all(p.exists() for p in kept)
    assert (run / ".link.npz.5.0123abcd.tmp").is_symlink()
    assert Folder(str(run)).sweep() == []  # the shallow sweep (the engine's start) finds nothing left either
