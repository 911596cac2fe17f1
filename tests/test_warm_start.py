"""The warm start (`warm_start`): a phase of its own before the fork, whose data the main
run continues (each batch trained once over both phases), whose learning-rate schedule
it continues, and which a restarted coordinator or another run does not train again."""

from __future__ import annotations

import functools
import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from archipelago.orchestrator.bench.simulation.pool import Fault, FaultKind, InProcessPool
from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.config_load import ConfigError, load_config
from archipelago.orchestrator.engine.build import PhasedRun
from archipelago.orchestrator.engine.commands import Stop
from archipelago.orchestrator.engine.outputs.outputs import Outputs
from archipelago.orchestrator.engine.step.slices import SlicedOuter
from archipelago.orchestrator.engine.types import RunFailed
from archipelago.orchestrator.engine.warm_start import warm_config
from archipelago.workers.runtime.optim import lr_factor
from tests.helpers import assert_trained_once, events

_keys = itertools.count()


def _cfg(tmp_path: Path, mode: str = "diloco", *extra: str) -> RunConfig:
    return load_config(
        None,
        [
            "task.factory=tests.toy_tasks:make_recording",
            "task.kwargs.centers=[[1.0,0.0],[-0.5,2.0],[0.5,0.5]]",
            f"task.kwargs.record=w{next(_keys)}",
            f"mode={mode}",
            "islands.count=3",
            "rounds=6",
            "inner_steps=4",
            "warm_start.steps=8",
            "inner.lr=0.05",
            "inner.warmup_steps=4",
            "checkpoint.every_rounds=2",
            f"out_dir={tmp_path / 'run'}",
            *extra,
        ],
    )


class KeepingPool(InProcessPool):
    """Keeps the islands it released, so a test can look at them after the run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.released: dict[int, Any] = {}

    def release(self, island: int) -> None:
        if island in self.islands:
            self.released[island] = self.islands[island]
        super().release(island)


class Pools:
    """The pool factory a `PhasedRun` calls, keeping every pool it made."""

    def __init__(self, faults: list[Fault] | None = None) -> None:
        self.made: list[tuple[str, KeepingPool]] = []
        self.faults = faults

    def __call__(self, cfg: RunConfig, run_id: str) -> KeepingPool:
        pool = KeepingPool(cfg, faults=self.faults if run_id.endswith("-warm") else None)
        self.made.append((run_id, pool))
        return pool


def _check_each_batch_once(cfg: RunConfig, summary: dict[str, Any]) -> None:
    """Over both phases: reads − lost work = each batch below its shard's final position,
    once; the two phases' tokens add up to the ledger's."""
    position = summary["shards"]["position"]
    assert_trained_once(cfg.task.kwargs["record"], position, [cfg.out_dir, Path(cfg.out_dir) / "warm_start"])
    everything = sum(p * (s + 1) for s, p in enumerate(position))  # a batch of shard s weighs s + 1
    assert summary["warm_start"]["tokens"] + summary["tokens"] == everything


@pytest.mark.parametrize(
    ("mode", "warm"), [("diloco", "ddp"), ("async", "ddp"), ("overlap", "single"), ("diloco", "average")]
)
def test_the_fork_continues_the_warm_starts_data_and_schedule(tmp_path, mode, warm):
    cfg = _cfg(tmp_path, mode, f"warm_start.mode={warm}", "warm_start.inner_steps=2")
    pools = Pools()
    run = PhasedRun(cfg, "w", pools)
    assert run.warming and run.engine.cfg.mode.name.value == ("ddp" if warm == "ddp" else "diloco")
    # average: Local SGD, rounds of warm_start.inner_steps whose outer step is the plain mean
    h = 2 if warm == "average" else 4
    assert (run.engine.cfg.inner_steps, run.engine.cfg.rounds) == (h, 8 // h)
    summary = run.execute()
    assert summary["state"] == "finished" and summary["rounds_done"] == 6
    record = summary["warm_start"]
    assert record["steps"] == 8 and record["mode"] == warm and record["islands"] == (1 if warm == "single" else 3)
    assert record["final_eval_loss"] < record["initial_eval_loss"]
    # the fork starts where the warm start ended (its last eval), not from the initialisation
    assert summary["initial_eval_loss"] == pytest.approx(record["final_eval_loss"], rel=1e-6)
    _check_each_batch_once(cfg, summary)
    # the islands after the fork stand at step 8 of one schedule of 8 + 6 x 4 steps
    (_, warm_pool), (_, main_pool) = pools.made
    spec = main_pool.released[0].spec
    assert (spec.start_step, spec.total_inner_steps) == (8, 32)
    assert warm_pool.cfg.schedule_steps == 32


# a 40-value model, so 2 coordinator slices cut on 16-value chunks hold 16 and 24 values
CENTERS = (
    "[" + ",".join("[" + ",".join(f"{((i * 7 + j) % 5 - 2) / 2:g}" for j in range(40)) + "]" for i in range(3)) + "]"
)


def _sliced_warm_cfg(tmp_path: Path, slices: int) -> RunConfig:
    """An average warm start of the 40-value model on `slices` coordinator slices."""
    return _cfg(
        tmp_path / f"s{slices}",
        "diloco",
        "warm_start.mode=average",
        "warm_start.inner_steps=2",
        "compression.chunk=16",
        f"task.kwargs.centers={CENTERS}",
        f"coordinator.shards={slices}",
    )


def test_an_average_warm_start_steps_on_the_runs_slices_as_one_coordinator_would(tmp_path):
    """At scale an average warm start must not pass through the head: it steps on the run's
    coordinator slices (under Ray each on a slice node, its part of every island's bytes
    there). A mean over parts is the whole mean, so the warm start and the run forked
    from it end bit for bit as on one coordinator; at the fork the warm phase's slices are
    released, so the main phase can place its own on those nodes."""
    ends = {}
    for slices in (1, 2):
        cfg = _sliced_warm_cfg(tmp_path, slices)
        run = PhasedRun(cfg, "w", Pools())
        assert run.warming and run.engine.cfg.coordinator.slices == slices
        released: list[bool] = []
        if slices > 1:
            calls = run.engine.outer.calls
            calls.release = functools.partial(released.append, True)  # a spy on the real slices' release
        summary = run.execute()
        assert released == ([True] if slices > 1 else [])
        _check_each_batch_once(cfg, summary)
        ends[slices] = summary
    one, two = ends[1], ends[2]
    for key in ("final_eval_loss", "final_params_digest", "tokens"):
        assert two["warm_start"][key] == one["warm_start"][key], key
    assert two["final_eval_loss"] == one["final_eval_loss"] and two["final_params_digest"] == one["final_params_digest"]


def test_a_sliced_warm_start_stopped_midway_resumes_from_its_slices_parts(tmp_path):
    """A warm start on slices checkpoints their parts beside it; a coordinator started
    again resumes the warm phase from them, on slices again, each batch trained once over
    both phases, and ends bit for bit where one coordinator stopped and resumed the same
    way ends."""
    ends = {}
    for slices in (1, 2):
        cfg = _sliced_warm_cfg(tmp_path, slices)
        runs: list[PhasedRun] = []
        # stopped once the warm phase's first round is recorded (at the end of the next)
        runs.append(PhasedRun(cfg, "r", Pools(), on_record=lambda *_, held=runs: held[0].engine.submit(Stop())))
        stopped = runs[0].execute()
        assert stopped["phase"] == "warm_start" and stopped["state"] == "stopped" and 0 < stopped["rounds_done"] < 4
        again = PhasedRun(cfg, "r", Pools())
        assert again.warming and again.engine.resumed and isinstance(again.engine.outer, SlicedOuter) == (slices > 1)
        ends[slices] = again.execute()
        _check_each_batch_once(cfg, ends[slices])
    one, two = ends[1], ends[2]
    assert two["warm_start"]["final_params_digest"] == one["warm_start"]["final_params_digest"]
    assert two["final_eval_loss"] == one["final_eval_loss"] and two["tokens"] == one["tokens"]


def test_a_data_parallel_warm_start_steps_on_one_coordinator(tmp_path):
    cfg = _cfg(tmp_path, "diloco", "warm_start.mode=ddp", "compression.chunk=16", f"task.kwargs.centers={CENTERS}")
    sliced = cfg.model_copy(update={"coordinator": cfg.coordinator.model_copy(update={"shards": 2})})
    assert warm_config(sliced).coordinator.slices == 1


class FreshPools(Pools):
    """Pools that take nothing over: the main phase places new islands, as forks did
    before islands were carried over."""

    def __call__(self, cfg: RunConfig, run_id: str) -> KeepingPool:
        pool = super().__call__(cfg, run_id)
        pool.adopt = lambda islands: None  # type: ignore[method-assign]
        return pool


@pytest.mark.parametrize(("warm", "carried"), [("average", [0, 1, 2]), ("single", [0])])
def test_the_main_phase_takes_the_warm_starts_islands_over_and_trains_the_same(tmp_path, warm, carried):
    """The warm start's islands go on as the main phase's (renewed in their processes, not
    placed again); the run is the one new islands give, loss for loss and batch for batch."""
    runs = {}
    for name, pools in (("carried", Pools()), ("fresh", FreshPools())):
        cfg = _cfg(tmp_path / name, "diloco", f"warm_start.mode={warm}", "warm_start.inner_steps=2")
        summary = PhasedRun(cfg, "w", pools).execute()
        _check_each_batch_once(cfg, summary)
        joins = [e for e in events(cfg.out_dir) if e["kind"] == "join"]
        runs[name] = (summary, pools, joins)
    (summary, pools, joins), (fresh, _, fresh_joins) = runs["carried"], runs["fresh"]
    assert summary["final_eval_loss"] == fresh["final_eval_loss"] and summary["tokens"] == fresh["tokens"]
    (_, warm_pool), (_, main_pool) = pools.made
    assert [i for i in range(3) if main_pool.released[i] is warm_pool.released.get(i)] == carried
    assert sorted(e["island"] for e in joins if e.get("adopted")) == carried
    assert not any(e.get("adopted") for e in fresh_joins)


def test_the_islands_learning_rate_after_the_fork_is_the_schedules_past_its_warmup(tmp_path):
    cfg = _cfg(tmp_path, "diloco", "elastic.join_rewarmup_steps=0")
    pools = Pools()
    PhasedRun(cfg, "lr", pools).execute()
    island = pools.made[1][1].released[0]
    done = 6 * 4  # inner steps each island took after the fork
    want = cfg.inner.lr * lr_factor(8 + done, cfg.inner, 32)
    assert island.optimizer.param_groups[0]["lr"] == pytest.approx(want)


@pytest.mark.parametrize("warm", ["average", "ddp"])
def test_a_crash_in_the_warm_start_loses_no_batch(tmp_path, warm):
    cfg = _cfg(tmp_path, "diloco", f"warm_start.mode={warm}", "warm_start.inner_steps=2")
    summary = PhasedRun(cfg, "crash", Pools([Fault(FaultKind.CRASH, 1, order=3)])).execute()
    assert summary["state"] == "finished"
    assert any(e["kind"] == "crash" for e in events(Path(cfg.out_dir) / "warm_start"))
    _check_each_batch_once(cfg, summary)


def test_a_restart_after_the_warm_start_does_not_train_it_again(tmp_path):
    cfg = _cfg(tmp_path)
    first = PhasedRun(cfg, "again", Pools())
    first.execute()
    pools = Pools()
    second = PhasedRun(cfg, "again", pools)  # what a coordinator Ray restarts builds
    assert not second.warming and [rid for rid, _ in pools.made] == ["again"]
    assert second.engine.resumed


def test_a_warm_start_is_reused_by_another_run_and_checked_to_fit(tmp_path):
    cfg = _cfg(tmp_path)
    summary = PhasedRun(cfg, "first", Pools()).execute()
    folder = Path(cfg.out_dir) / "warm_start"
    other = _cfg(tmp_path / "b", "async", f"warm_start.path={folder}")
    other = other.model_copy(update={"task": cfg.task})  # same task (and recording key)
    pools = Pools()
    reused = PhasedRun(other, "second", pools)
    assert not reused.warming and len(pools.made) == 1
    again = reused.execute()
    assert again["initial_eval_loss"] == pytest.approx(summary["warm_start"]["final_eval_loss"])
    assert again["warm_start"]["path"] == str(folder.resolve())
    # data-parallel continues the same warm start (the baseline a method is compared with)
    ddp = _cfg(tmp_path / "d", "ddp", f"warm_start.path={folder}").model_copy(update={"task": cfg.task})
    continued = PhasedRun(ddp, "ddp", Pools()).execute()
    assert continued["initial_eval_loss"] == pytest.approx(summary["warm_start"]["final_eval_loss"])
    warm_batches = 8 * 3  # steps x islands of the warm start
    assert sum(continued["shards"]["position"]) == warm_batches + 6 * 4 * 3
    for bad, field in (("seed=3", "seed"), ("warm_start.steps=4", "warm_start.steps")):
        wrong = _cfg(tmp_path / "c", "diloco", f"warm_start.path={folder}", bad)
        with pytest.raises(RunFailed, match=re.escape(field)):
            PhasedRun(wrong.model_copy(update={"task": cfg.task}), "x", Pools())


def test_the_fork_takes_the_warm_starts_final_evaluation_only_for_the_model_it_was_of(tmp_path, monkeypatch):
    """The main phase starts from the warm start's last model: its evaluation there is the
    main run's first, taken, not run again beside the islands' first work. Loaded
    parameters that do not hash to the recorded digest are evaluated as before."""
    calls = []
    submit = Outputs._submit  # every evaluation, wherever it runs, is submitted here
    monkeypatch.setattr(Outputs, "_submit", lambda self, version: calls.append(version) or submit(self, version))
    cfg = _cfg(tmp_path)
    summary = PhasedRun(cfg, "first", Pools()).execute()
    record = summary["warm_start"]
    assert summary["initial_eval_loss"] == record["final_eval_loss"]  # the same number, not one recomputed
    assert len(record["final_params_digest"]) == 32
    folder = Path(cfg.out_dir) / "warm_start"
    marker = folder / "warm_start.json"
    stamped = json.loads(marker.read_text())
    calls.clear()
    reused = _cfg(tmp_path / "b", "diloco", f"warm_start.path={folder}").model_copy(update={"task": cfg.task})
    PhasedRun(reused, "second", Pools()).execute()
    taken = len(calls)
    marker.write_text(json.dumps({**stamped, "final_params_digest": "0" * 32}))  # not the loaded model's
    calls.clear()
    other = _cfg(tmp_path / "c", "diloco", f"warm_start.path={folder}").model_copy(update={"task": cfg.task})
    again = PhasedRun(other, "third", Pools()).execute()
    assert len(calls) == taken + 1  # the first evaluation ran
    assert again["initial_eval_loss"] == pytest.approx(record["final_eval_loss"], rel=1e-6)


def test_a_run_stopped_in_its_warm_start_says_so(tmp_path):
    run = PhasedRun(_cfg(tmp_path), "stop", Pools())
    run.engine.submit(Stop(now=True))
    summary = run.execute()
    assert summary["phase"] == "warm_start" and summary["state"] == "stopped"
    assert not (Path(run.cfg.out_dir) / "warm_start" / "warm_start.json").exists()


def test_warm_start_settings(tmp_path):
    auto = load_config(None, ["rounds=12", "inner_steps=30", "inner.warmup_steps=50"])
    assert auto.warm_steps == 90 and auto.schedule_steps == 450  # a quarter of 12 x 30, then the rounds
    assert load_config(None, ["rounds=2", "inner_steps=10", "inner.warmup_steps=50"]).warm_steps == 50
    assert load_config(None, ["mode=ddp"]).warm_steps == 0
    model = tmp_path / "final.pt"
    torch.save({"x": torch.zeros(1)}, model)
    assert load_config(None, [f"init_from={model}"]).warm_steps == 0  # already trained
    with pytest.raises(ConfigError, match=r"warm_start\.path"):
        load_config(None, ["mode=ddp", "warm_start.steps=10"])
    with pytest.raises(ConfigError, match="warm_start"):
        load_config(None, [f"warm_start.path={tmp_path / 'nowhere'}"])
    # the warm phase: rounds of its H when they divide its steps, else one round; its H is
    # warm_start.inner_steps averaging (the default), the run's inner_steps data-parallel
    assert (warm_config(auto).rounds, warm_config(auto).inner_steps) == (1, 90)  # 25 does not divide 90
    every_15 = auto.model_copy(update={"warm_start": auto.warm_start.model_copy(update={"inner_steps": 15})})
    assert (warm_config(every_15).rounds, warm_config(every_15).inner_steps) == (6, 15)
    ddp = load_config(None, ["rounds=12", "inner_steps=30", "inner.warmup_steps=50", "warm_start.mode=ddp"])
    assert (warm_config(ddp).rounds, warm_config(ddp).inner_steps) == (3, 30)
    odd = load_config(None, ["inner_steps=30", "warm_start.steps=45", "warm_start.mode=ddp"])
    assert (warm_config(odd).rounds, warm_config(odd).inner_steps) == (1, 45)


def test_the_driver_refuses_a_warm_start_that_does_not_fit_before_ray_starts(tmp_path):
    """Not a coordinator failing in its constructor (and restarted by Ray) minutes later."""
    from archipelago.orchestrator.runtime.driver import run

    cfg = _cfg(tmp_path)
    PhasedRun(cfg, "fits", Pools()).execute()
    folder = Path(cfg.out_dir) / "warm_start"
    wrong = _cfg(tmp_path / "b", "diloco", f"warm_start.path={folder}", "seed=4")
    with pytest.raises(RunFailed, match="seed"):
        run(wrong.model_copy(update={"task": cfg.task}), show_progress=False)
