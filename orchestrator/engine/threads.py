"""How many torch threads the coordinator's own work takes: the cores of its node that
its islands there do not reserve, so a KubeRay head whose islands are on worker nodes
uses all its cores, and a machine whose islands reserve every core keeps one thread."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

import torch

from orchestrator.config import RunConfig


def spare_cores(cfg: RunConfig, islands_here: int) -> int:
    """The cores this process may run on less those `islands_here` islands on its host
    reserve (`islands.cpus` per worker); can be 0 or less."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores - math.ceil(islands_here * cfg.islands.workers * cfg.islands.cpus)


def step_threads(cfg: RunConfig, islands_here: int) -> int:
    """The outer step's torch threads: `coordinator.threads`, or the spare cores, at least
    one. The step is bound by memory bandwidth, which one core does not saturate (`bench
    datapath`, 4 updates of 32 MB on 2 cores: 9 ms a step on 1 thread, 7 ms on 2). A step
    every island waits for passes `islands_here` 0 (`Outputs.step_threads`)."""
    return cfg.coordinator.threads or max(1, spare_cores(cfg, islands_here))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block on `n` torch threads, then put the process's count back."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
