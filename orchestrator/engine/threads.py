"""How many torch threads the coordinator's own work takes: the cores of its node that
its islands there do not reserve, so a KubeRay head whose islands are on worker nodes
uses all its cores, and a machine whose islands reserve every core keeps one thread."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from pathlib import Path

from ..config import RunConfig


def cgroup_cpus(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in cores (a Kubernetes pod's CPU limit), None
    when there is none. cgroup v2's `cpu.max` ("400000 100000": 4 cores; "max": none), or
    v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        q = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        p = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None


def usable_cores(root: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may use: those it may run on, capped by its cgroup's quota.
    Under a Kubernetes CPU limit `sched_getaffinity` lists every core of the host, and
    threads sized by it oversubscribe the pod's share (and get throttled)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpus(root)
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def spare_cores(cfg: RunConfig, islands_here: int) -> int:
    """The cores this process may use (`usable_cores`) less those `islands_here` islands on
    its host reserve (`islands.cpus` per worker); can be 0 or less."""
    cores = usable_cores()
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
    import torch  # here, not at the top: `usable_cores` serves the run's torch-free preflight

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
