"""The coordinator's evaluations use the cores it has: those of its host that its islands
there do not reserve (a KubeRay head's spare cores), or `coordinator.eval_threads`."""

from __future__ import annotations

import os
import socket

import torch

from tests.engine_scenarios import drive, scenario_cfg
from tests.helpers import in_process_engine


def test_evaluations_take_the_cores_no_island_on_this_host_reserves(tmp_path, monkeypatch):
    cfg = scenario_cfg(tmp_path, "diloco", "islands.cpus=1", "rounds=1")
    engine, _ = in_process_engine(cfg)
    drive(engine)
    outputs = engine.outputs
    cores = len(os.sched_getaffinity(0))
    assert outputs.eval_threads() == cores  # in-process islands are on no host of their own
    host = socket.gethostname()
    for stats in list(engine.members.islands.values())[:2]:
        stats.state = type(stats.state).TRAINING
        stats.node = f"{host}:cpu"
    assert outputs.eval_threads() == max(cfg.coordinator.threads, cores - 2)
    outputs.cfg = cfg.model_copy(update={"coordinator": cfg.coordinator.model_copy(update={"eval_threads": 3})})
    seen = []
    loss = outputs.task.loss
    monkeypatch.setattr(
        outputs.task, "loss", lambda model, batch: seen.append(torch.get_num_threads()) or loss(model, batch)
    )
    before = torch.get_num_threads()
    outputs.evaluate()
    assert set(seen) == {3} and torch.get_num_threads() == before  # the step's threads are put back
