"""Islands' inner state across a resume (`workers/runtime/inner_state.py`,
`engine/fleet/island_states.py`): the flat arrays give back an optimizer that steps exactly as
the original would; a state file that is gone or altered costs that island its moments,
never the run; the coordinator asks for states only before checkpoints; and every
mode's resumed islands continue from the moments the checkpoint named."""

from __future__ import annotations

import dataclasses
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from archipelago.orchestrator.bench.simulation.pool import InProcessPool
from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.build import build_engine
from archipelago.orchestrator.engine.fleet.island_states import FOLDER, save_due
from archipelago.orchestrator.engine.specs import island_spec
from archipelago.orchestrator.engine.state.checkpoints import load_checkpoint
from archipelago.workers.runtime import inner_state
from archipelago.workers.runtime.inner_state import InnerStateError
from archipelago.workers.runtime.island import Island
from archipelago.workers.runtime.storage import digest_name
from archipelago.workers.wire.messages import SavedState, WorkKind
from tests.engine_scenarios import check_exactly_once, drive, scenario_cfg
from tests.helpers import TINY_LM, events, in_process_engine


def _trained(optimizer_cls, **kwargs) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    opt = optimizer_cls(model.parameters(), **kwargs)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    torch.manual_seed(1)
    opt.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize(
    ("cls", "kwargs", "kinds"),
    [
        (torch.optim.AdamW, {"lr": 0.01}, ["exp_avg", "exp_avg_sq", "scalar:step"]),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, ["momentum_buffer"]),
        (torch.optim.SGD, {"lr": 0.1}, []),  # no momentum: nothing to keep
    ],
)
def test_a_restored_optimizer_steps_exactly_as_the_original(cls, kwargs, kinds):
    model, opt = _trained(cls, **kwargs)
    arrays = inner_state.capture(opt, {"all": np.arange(3, dtype=np.float32)})
    assert sorted(k for k in arrays if not k.startswith("feedback:")) == kinds
    twin = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    twin.load_state_dict(model.state_dict())
    fresh = cls(twin.parameters(), **kwargs)
    residuals = inner_state.restore(fresh, arrays)
    np.testing.assert_array_equal(residuals["all"], np.arange(3, dtype=np.float32))
    assert torch.equal(_step(model, opt), _step(twin, fresh))


def test_a_state_file_is_checked_before_use(tmp_path):
    _, opt = _trained(torch.optim.AdamW, lr=0.01)
    saved = inner_state.save(str(tmp_path), 3, inner_state.capture(opt, {}))
    assert saved.name.startswith("island-00003-") and len(inner_state.load(str(tmp_path), saved)) == 3
    data = bytearray((tmp_path / saved.name).read_bytes())
    data[-40] ^= 1
    (tmp_path / saved.name).write_bytes(bytes(data))
    with pytest.raises(InnerStateError, match="SHA-256"):
        inner_state.load(str(tmp_path), saved)
    with pytest.raises(InnerStateError, match=r"gone\.npz"):
        inner_state.load(str(tmp_path), SavedState(name="gone.npz", sha256=saved.sha256))
    other = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(InnerStateError, match="this model needs"):
        inner_state.restore(other, inner_state.capture(opt, {}))


def test_a_state_is_trusted_only_with_its_digest(tmp_path):
    """A state written off the round's path is named before its digest exists: the digest
    written beside it, last, is what a record without one is checked against."""
    _, opt = _trained(torch.optim.AdamW, lr=0.01)
    saved = inner_state.save(str(tmp_path), 3, inner_state.capture(opt, {}))
    named = SavedState(name=saved.name)  # as a result names it
    assert (tmp_path / digest_name(saved.name)).read_text() == saved.sha256
    assert sorted(inner_state.load(str(tmp_path), named)) == ["exp_avg", "exp_avg_sq", "scalar:step"]
    data = bytearray((tmp_path / saved.name).read_bytes())
    data[-40] ^= 1
    (tmp_path / saved.name).write_bytes(bytes(data))
    with pytest.raises(InnerStateError, match="SHA-256"):
        inner_state.load(str(tmp_path), named)
    (tmp_path / digest_name(saved.name)).unlink()  # a write that never ended
    with pytest.raises(InnerStateError, match=r"\.sha256"):
        inner_state.load(str(tmp_path), named)


def test_a_state_is_loaded_without_holding_it_twice(tmp_path):
    """Hashed as a stream, then read array by array: the load's peak is the state's size,
    not the file's bytes beside the arrays made of them (2× before)."""
    arrays = {"exp_avg": np.ones(4_000_000, np.float32), "exp_avg_sq": np.full(4_000_000, 2.0, np.float32)}
    saved = inner_state.save(str(tmp_path), 0, arrays)
    state = sum(v.nbytes for v in arrays.values())
    tracemalloc.start()
    try:
        loaded = inner_state.load(str(tmp_path), SavedState(name=saved.name))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(np.array_equal(loaded[k], arrays[k]) for k in arrays)
    assert peak < 1.2 * state, (peak, state)


def test_the_result_leaves_before_its_state_is_written_and_the_file_holds_the_state_it_left(tmp_path, monkeypatch):
    """The write is held until the island has trained its next work: the result came back
    at once, without a file; the next work waited only for the snapshot; and the file,
    once written, holds the moments the first work left, not the ones trained since."""
    cfg = load_config(None, [*TINY_LM, "inner.optimizer=adamw", "inner.lr=0.01"])
    island = Island(dataclasses.replace(island_spec(cfg, 0), state_folder=str(tmp_path)))
    gate, save = threading.Event(), inner_state.save

    def held(*args, **kwargs):
        assert gate.wait(60)
        return save(*args, **kwargs)

    monkeypatch.setattr(inner_state, "save", held)
    params = island.flat.full().detach().numpy().copy()
    first = island.run(dataclasses.replace(island.order(0, 3), save_state=True), params)
    left = _moments(island)
    saved = first.saved_state
    assert saved is not None and saved.sha256 is None and not (tmp_path / saved.name).exists()
    island.run(island.order(0, 3), params)  # beside the held write
    assert not (tmp_path / saved.name).exists()
    moved = _moments(island)
    gate.set()
    island.written()
    written = inner_state.load(str(tmp_path), saved)
    assert sorted(written) == sorted(left)
    for kind, values in left.items():
        np.testing.assert_array_equal(written[kind], values)
    assert not np.array_equal(moved["exp_avg"], left["exp_avg"])  # the snapshot, not a late read


def test_states_are_asked_for_only_in_the_rounds_before_a_checkpoint():
    every5 = load_config(None, ["rounds=12", "checkpoint.every_rounds=5"])
    asked = [r for r in range(12) if save_due(every5, WorkKind.TRAIN, r, 4)]
    assert asked == [4, 9, 11]  # the work of rounds 5, 10 and the last (12)
    assert not save_due(every5, WorkKind.GRADIENT, 4, 4)
    lagged = load_config(None, ["rounds=12", "checkpoint.every_rounds=5", "mode=overlap"])
    assert [r for r in range(12) if save_due(lagged, WorkKind.TRAIN, r, 4)] == [3, 4, 8, 9, 10, 11]
    per_arrival = load_config(None, ["rounds=40", "checkpoint.every_rounds=20", "mode=async"])
    assert [r for r in range(40) if save_due(per_arrival, WorkKind.TRAIN, r, 4)] == [15, 16, 17, 18, 19, *range(35, 40)]


def _moments(island: Island) -> dict[str, np.ndarray]:
    return inner_state.capture(island.optimizer, {})


@pytest.mark.parametrize("mode", ["diloco", "overlap", "async", "streaming"])
def test_a_killed_run_resumes_with_every_islands_moments_and_a_lost_file_costs_only_its_own(
    tmp_path, mode, monkeypatch
):
    """Coordinator and islands gone; a new pool's islands continue from the moments the
    checkpoint named — except island 1, whose file was deleted: it starts fresh, says so in
    its join event, and the run still trains every batch once."""
    written: dict[str, dict[str, np.ndarray]] = {}
    run = Island.run

    def run_and_remember(island: Island, order, params):
        result = run(island, order, params)
        if result.saved_state is not None:
            written[result.saved_state.name] = _moments(island)
        return result

    monkeypatch.setattr(Island, "run", run_and_remember)
    cfg = scenario_cfg(tmp_path, mode, "inner.optimizer=adamw", "inner.lr=0.01", "checkpoint.every_rounds=2")
    first, killed = in_process_engine(cfg, run_id="kill")
    drive(first, until=4)
    killed.close()  # its islands go with it (the work they had out read its batches before)
    checkpoint = load_checkpoint(Path(cfg.checkpoint_dir) / "kill")
    named = {
        int(i): m["inner_state"] for i, m in checkpoint["membership"]["members"].items() if m["state"] == "training"
    }
    assert sorted(named) == [0, 1, 2]
    (Path(cfg.checkpoint_dir) / "kill" / FOLDER / named[1]).unlink()
    saved = checkpoint["ledger"]["position"]
    lost = Counter((s, i) for s, p in enumerate(first.ledger.position) for i in range(saved[s], p))
    pool = InProcessPool(cfg)
    second = build_engine(cfg, pool, run_id="kill")
    second.start()
    for i in (0, 2):
        restored = _moments(pool.islands[i])
        for kind, values in written[named[i]].items():
            np.testing.assert_array_equal(restored[kind], values)
    assert pool.islands[1].restored is False and not pool.islands[1].optimizer.state
    while second.step():
        pass
    check_exactly_once(cfg, second.summary, lost)
    joins = {e["island"]: e["inner_state"] for e in events(cfg.out_dir) if e["kind"] == "join" and "inner_state" in e}
    assert joins == {0: "restored", 1: "lost", 2: "restored"}


def test_muon_beside_adamw_is_saved_group_by_group_and_steps_exactly_as_the_original():
    from archipelago.workers.runtime.optim import build_inner, muon_params
    from archipelago.workers.wire.spec import InnerConfig

    cfg = InnerConfig(optimizer="muon", warmup_steps=0)

    def build(model: torch.nn.Module) -> torch.optim.Optimizer:
        return build_inner(cfg, model.parameters(), 100, muon=muon_params(model))[0]

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    opt = build(model)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    arrays = inner_state.capture(opt, {})
    assert {k.split("/")[0] for k in arrays} == {"g0", "g1"} and "g0/momentum_buffer" in arrays
    twin = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    twin.load_state_dict(model.state_dict())
    fresh = build(twin)
    inner_state.restore(fresh, arrays)
    assert torch.equal(_step(model, opt), _step(twin, fresh))
    with pytest.raises(inner_state.InnerStateError, match="parameter groups"):
        inner_state.restore(build(twin), {"g7/exp_avg": np.zeros(3, np.float32)})


def test_a_state_whose_write_never_ended_is_not_named_the_checkpoint_names_the_one_before(tmp_path, monkeypatch):
    """Before: a checkpoint named each island's newest state as its result arrived, while
    the file was still being written; island 1 killed mid-write (here: every write of it
    after the first fails, as a write cut short leaves it: no digest beside it) resumed
    with fresh moments. The checkpoint now waits for the writes in progress — island 0's
    are slow (0.5 s each) and are named all the same, the same generation as island 2's —
    and names, for an island whose file is not on storage, the newest of its states before
    it that is (kept, with its digest): two failed writes back, island 1's first. The
    resume restores every island's moments."""
    written: dict[str, dict[str, np.ndarray]] = {}
    run, save = Island.run, inner_state.save
    names: dict[int, list[str]] = {0: [], 1: [], 2: []}

    def run_and_remember(island: Island, order, params):
        result = run(island, order, params)
        if result.saved_state is not None:
            written[result.saved_state.name] = _moments(island)
        return result

    def slow_or_cut_short(folder, island, arrays, name=None):
        names[island].append(name)
        if island == 0:
            time.sleep(0.5)
        if island == 1 and len(names[1]) >= 2:
            raise OSError("the island's node went down mid-write")
        return save(folder, island, arrays, name)

    monkeypatch.setattr(Island, "run", run_and_remember)
    monkeypatch.setattr(inner_state, "save", slow_or_cut_short)
    cfg = scenario_cfg(
        tmp_path, "diloco", "rounds=10", "inner.optimizer=adamw", "inner.lr=0.01", "checkpoint.every_rounds=2"
    )
    first, killed = in_process_engine(cfg, run_id="cut")
    drive(first, until=8)
    first.outputs.fence()  # the round-8 checkpoint on disk
    killed.close()
    checkpoint = load_checkpoint(Path(cfg.checkpoint_dir) / "cut")
    assert checkpoint["counters"]["rounds_done"] == 8
    members = {int(i): m for i, m in checkpoint["membership"]["members"].items()}
    named = {i: m["inner_state"] for i, m in members.items()}
    folder = Path(cfg.checkpoint_dir) / "cut" / FOLDER
    failed = names[1][1:]
    assert not any((folder / digest_name(name)).exists() for name in failed)
    generation = names[2].index(named[2])
    assert generation >= 2 and names[1][generation] in failed and names[1][generation - 1] in failed
    assert named[1] == names[1][0] and named[0] == names[0][generation]  # two back; the slow one waited for
    for i in (0, 1, 2):
        assert (folder / named[i]).exists() and members[i]["inner_state_sha256"] is not None
    assert named[1] in checkpoint["island_states"]  # kept: no sweep deletes it
    pool = InProcessPool(cfg)
    second = build_engine(cfg, pool, run_id="cut")
    second.start()
    for i in (0, 1, 2):
        restored = _moments(pool.islands[i])
        for kind, values in written[named[i]].items():
            np.testing.assert_array_equal(restored[kind], values)
    while second.step():
        pass
    joins = {e["island"]: e["inner_state"] for e in events(cfg.out_dir) if e["kind"] == "join" and "inner_state" in e}
    assert joins == {0: "restored", 1: "restored", 2: "restored"}
