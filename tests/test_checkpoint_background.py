"""The checkpoint off the engine's thread: while a slow write streams the state, the engine
goes on — the islands get their next work, their results come in — and only the next
outer step waits for the write (the fence), so the file holds exactly the state of the
round it was taken at, no second copy of the parameters is made, and a run whose write is
slow ends with the same model and files as one whose write is instant."""

from __future__ import annotations

import threading
import time

import torch

from archipelago.orchestrator.engine import engine as engine_module
from archipelago.orchestrator.engine.state import checkpoints
from tests.engine_scenarios import check_exactly_once, scenario_cfg
from tests.helpers import events, in_process_engine


def test_a_slow_checkpoint_write_holds_back_only_the_next_outer_step(tmp_path, monkeypatch):
    cfg = scenario_cfg(tmp_path, "diloco", "rounds=4", "checkpoint.every_rounds=2")
    release, writing = threading.Event(), threading.Event()
    save = checkpoints.save_checkpoint

    def held_save(location, state, keep=3, name=None):  # round 2's write takes as long as the test says
        if state["counters"]["rounds_done"] == 2:
            writing.set()
            assert release.wait(60), "the test never released the write"
        return save(location, state, keep, name)

    shared = []
    capture = engine_module.capture

    def spy(core, flights, location, name):
        state = capture(core, flights, location, name)
        shared.append(state["params"].data_ptr() == core.flat.data.data_ptr())
        return state

    monkeypatch.setattr(checkpoints, "save_checkpoint", held_save)
    monkeypatch.setattr(engine_module, "capture", spy)
    engine, _ = in_process_engine(cfg.model_copy(update={"out_dir": str(tmp_path / "slow")}), run_id="slow")
    failed: list[BaseException] = []

    def run() -> None:
        try:
            engine.execute()
        except BaseException as err:  # handed to the test's thread
            failed.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert writing.wait(60)
    # the write is out: the engine hands round 3's work out and takes its results meanwhile
    deadline = time.monotonic() + 60
    while not (engine.flights and all(f.result is not None for f in engine.flights.values())):
        assert time.monotonic() < deadline and thread.is_alive(), "round 3's results never came in during the write"
        time.sleep(0.01)
    assert {f.work.version for f in engine.flights.values()} == {2}  # round 3 trains from version 2
    time.sleep(0.3)  # the engine is at the fence, not past it: no step while the write reads the state
    assert engine.run.version == 2 and engine.outputs.saving is not None
    assert not any(e["kind"] == "checkpoint" for e in events(engine.recorder.out))
    release.set()
    thread.join(60)
    assert not thread.is_alive() and not failed, failed

    summary = engine.summary
    assert summary["rounds_done"] == 4 and shared == [True, True]  # the live tensors, not copies
    check_exactly_once(engine.cfg, summary)
    assert [e["round"] for e in events(engine.recorder.out) if e["kind"] == "checkpoint"] == [2, 4]
    monkeypatch.undo()
    reference, _ = in_process_engine(cfg.model_copy(update={"out_dir": str(tmp_path / "ref")}), run_id="ref")
    reference.execute()
    for sequence in (1, 2):  # round 2's and round 4's files: the states a run with instant writes saved
        ours = _nth(engine, sequence)
        theirs = _nth(reference, sequence)
        assert ours["counters"]["rounds_done"] == theirs["counters"]["rounds_done"] == 2 * sequence
        assert torch.equal(ours["params"], theirs["params"])
        assert ours["ledger"] == theirs["ledger"]
    assert torch.equal(engine.flat.data, reference.flat.data)


def _nth(engine, sequence: int) -> dict:
    folder = checkpoints._folder(engine.checkpoints)
    name = f"state-{sequence:06d}.pt"
    return checkpoints._load_one(folder, name)[1]
