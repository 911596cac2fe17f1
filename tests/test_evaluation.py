"""The coordinator's evaluations and outer steps use the cores it has: those of its host
that its islands there do not reserve (a KubeRay head's spare cores), or
`coordinator.eval_threads` / `coordinator.threads`."""

from __future__ import annotations

import socket

import torch

from archipelago.orchestrator.engine import engine as engine_module
from archipelago.orchestrator.engine.threads import step_threads, usable_cores
from tests.engine_scenarios import drive, scenario_cfg
from tests.helpers import in_process_engine


def test_evaluations_take_the_cores_no_island_on_this_host_reserves(tmp_path, monkeypatch):
    cfg = scenario_cfg(tmp_path, "diloco", "islands.cpus=1", "rounds=1")
    engine, _ = in_process_engine(cfg)
    drive(engine)
    outputs = engine.outputs
    cores = usable_cores()
    assert outputs.eval_threads() == cores  # in-process islands are on no host of their own
    host = socket.gethostname()
    for stats in list(engine.members.islands.values())[:2]:
        stats.state = type(stats.state).TRAINING
        stats.node = f"{host}:cpu"
    assert outputs.eval_threads() == outputs.step_threads() == max(1, cores - 2)
    outputs.cfg = cfg.model_copy(update={"coordinator": cfg.coordinator.model_copy(update={"eval_threads": 3})})
    seen = []
    loss = outputs.task.loss
    monkeypatch.setattr(
        outputs.task, "loss", lambda model, batch: seen.append(torch.get_num_threads()) or loss(model, batch)
    )
    before = torch.get_num_threads()
    outputs.evaluate(engine.run.version)
    assert set(seen) == {3} and torch.get_num_threads() == before  # the step's threads are put back


def test_outer_steps_take_the_spare_cores_and_put_the_count_back(tmp_path, monkeypatch):
    cfg = scenario_cfg(tmp_path, "diloco", "islands.cpus=1", "rounds=2")
    engine, _ = in_process_engine(cfg)
    cores = usable_cores()
    seen: list[tuple[int, int]] = []
    take_step = engine_module.take_step

    def spy(*args, **kwargs):
        seen.append((torch.get_num_threads(), engine.outputs.step_threads()))
        return take_step(*args, **kwargs)

    monkeypatch.setattr(engine_module, "take_step", spy)
    before = torch.get_num_threads()
    drive(engine)
    assert seen and all(used == wanted for used, wanted in seen)  # every step on the threads it asked for
    assert seen[0][0] == cores  # in-process islands reserve no core of this host
    assert torch.get_num_threads() == before
    pinned = cfg.model_copy(update={"coordinator": cfg.coordinator.model_copy(update={"threads": 3})})
    assert step_threads(pinned, islands_here=99) == 3  # set, it is what it says
    assert step_threads(cfg, islands_here=cores + 4) == 1  # islands reserve every core: one thread
    monkeypatch.setattr(engine.outputs, "_islands_here", lambda: cores + 4)
    assert engine.outputs.step_threads(islands_wait=False) == 1
    assert engine.outputs.step_threads(islands_wait=True) == cores  # they wait for the step: their cores are idle


def test_only_a_barrier_s_islands_wait_for_its_step(tmp_path):
    """Which pacings let the step take the islands' cores: a barrier's islands have all
    answered when it closes; a one-round lag's next round, a streaming island's τ tail and
    the asynchronous pacings' other islands train during it."""
    waits = {}
    for mode, extra in [
        ("diloco", []),
        ("overlap", []),
        ("async", []),
        ("streaming", ["mode.tau=0"]),
        ("streaming", ["mode.tau=1"]),
    ]:
        cfg = scenario_cfg(tmp_path, mode, *extra)
        engine, _ = in_process_engine(cfg)
        waits[(mode, tuple(extra))] = engine.pacing.islands_wait
    assert waits == {
        ("diloco", ()): True,
        ("overlap", ()): False,
        ("async", ()): False,
        ("streaming", ("mode.tau=0",)): True,
        ("streaming", ("mode.tau=1",)): False,
    }


def test_threads_follow_the_cgroup_cpu_quota_of_a_pod(tmp_path):
    """A Kubernetes CPU limit is a cgroup quota: `sched_getaffinity` still lists every host
    core, so the thread count is capped by the quota (v2 `cpu.max`, or v1's pair)."""
    from archipelago.orchestrator.engine.threads import cgroup_cpus, usable_cores

    cores = usable_cores()
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpus(v2) == 1.5 and usable_cores(v2) == min(cores, 2)
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpus(v2) is None and usable_cores(v2) == cores
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("100000")
    (v1 / "cpu.cfs_period_us").write_text("100000")
    assert cgroup_cpus(v1.parent) == 1.0 and usable_cores(v1.parent) == 1
    (v1 / "cpu.cfs_quota_us").write_text("-1")
    assert cgroup_cpus(v1.parent) is None
    assert cgroup_cpus(tmp_path / "none") is None
