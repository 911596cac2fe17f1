"""The plan `archipelago run` checks before it starts anything.

The model's measurement comes from `cache.py` (measured once per shape, then read from
a file without importing torch). The cluster is this machine for a private Ray
instance; on a Ray cluster, the node the driver runs on (the head: its cgroup's memory
limit is the pod's) and the other nodes that are up. Islands whose nodes are not up yet
(an autoscaler adds them) are not checked, and the log says so.
"""

from __future__ import annotations

import dataclasses
import logging

from ..config import RunConfig
from .cache import model_memory
from .cluster import Cluster, ClusterError, ray_nodes, this_machine
from .planner import Plan, make_plan, on_cpu

log = logging.getLogger(__name__)


class PlanRefused(RuntimeError):
    """The run's plan does not fit the cluster it is about to start on."""


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
    for (the private Ray instance is given that many), and are planned there. Slices
    and codecs left `auto` are chosen by this plan (`Plan.slices`, `Plan.codecs`; the
    slices up to the slice nodes up or stated by the head): the run trains with them."""
    try:
        cluster = run_cluster(on_ray_cluster)
    except (
        ClusterError
    ) as err:  # the head's stated link or slice nodes ($ARCHIPELAGO_LINK_GBPS, ..._SLICE_NODES) unreadable
        raise PlanRefused(str(err)) from None
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
    for choice in (plan.slices, plan.codecs):
        if choice is not None:
            log.info("plan: %s", " ".join(choice.lines()))
    if problems:
        raise PlanRefused("; ".join(problems))
    return plan
