"""The plan `archipelago run` checks before it starts anything.

The model's measurement (`measure.py`) depends only on the task, its arguments, the
inner loop's settings and torch's version, so it is cached on disk under that key: the
first run of a config pays a few seconds (torch imported, fake tensors), every later run
reads a file and imports nothing heavy. The cluster is this machine for a private Ray
instance; on a Ray cluster, the node the driver runs on (the head: its cgroup's memory
limit is the pod's) and the other nodes that are up. Islands whose nodes are not up yet
(an autoscaler adds them) are not checked, and the log says so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
from pathlib import Path

from orchestrator.config import RunConfig
from orchestrator.plan.cluster import Cluster, ray_nodes, this_machine
from orchestrator.plan.memory import ModelMemory
from orchestrator.plan.planner import Plan, make_plan, on_cpu

log = logging.getLogger(__name__)

FORMAT = 3  # the measurement's fields; a cached one of another format is measured again


class PlanRefused(RuntimeError):
    """The run's plan does not fit the cluster it is about to start on."""


def _cache_dir() -> Path:
    from workers.tasks.corpus import default_cache_dir

    return default_cache_dir() / "plans"


def _key(cfg: RunConfig) -> str:
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "?"
    shape = {
        "format": FORMAT,
        "torch": torch_version,
        "task": cfg.task.model_dump(mode="json"),
        "inner": cfg.inner.model_dump(mode="json"),
        "compression": cfg.compression.model_dump(mode="json"),
        "workers": cfg.islands.workers,
        "shards": cfg.num_shards,
        "seed": cfg.seed,
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:24]


def model_memory(cfg: RunConfig) -> ModelMemory:
    """The model's measurement for `cfg`, from the cache or measured (and cached)."""
    path = _cache_dir() / f"{_key(cfg)}.json"
    try:
        return ModelMemory(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    from orchestrator.plan.measure import measure
    from workers.tasks.task import load_task

    found = measure(cfg, load_task(cfg.task.factory, cfg.task.kwargs))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(found)))
        os.replace(tmp, path)
    except OSError as err:  # a read-only home: measured again next time
        log.debug("plan cache not written: %s", err)
    return found


def run_cluster(on_ray_cluster: bool) -> Cluster:
    """What `run` checks against: this machine, or this node and the Ray cluster's others."""
    here = this_machine()
    if not on_ray_cluster:
        return here
    import ray

    others = ray_nodes(leave_out=ray.get_runtime_context().get_node_id())
    head = dataclasses.replace(here.head, name="this node (the driver's)")
    return Cluster(source="the Ray cluster", head=head, workers=tuple(others))


def preflight(cfg: RunConfig, *, on_ray_cluster: bool) -> Plan:
    """The run's plan; raises `PlanRefused` listing what does not fit. On a cluster, a
    process whose node is not up yet is logged as not checked, not refused. On a machine
    without CUDA the islands and the evaluator train on its CPU whatever GPUs they ask
    for (the private Ray instance is given that many), and are planned there."""
    cluster = run_cluster(on_ray_cluster)
    if not on_ray_cluster and not cluster.head.gpus:
        cfg = on_cpu(cfg)
    plan = make_plan(cfg, model_memory(cfg), cluster)
    problems = plan.problems
    if on_ray_cluster:  # nodes an autoscaler adds later are not up to be checked
        waiting = [p for p in problems if "no node of" in p]
        for p in waiting:
            log.info("plan: %s (not checked: the autoscaler may add such nodes)", p)
        problems = [p for p in problems if p not in waiting]
    for line in plan.lines():
        log.debug("plan: %s", line)
    if problems:
        raise PlanRefused("; ".join(problems))
    return plan
