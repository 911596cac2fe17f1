"""Places island actors: one placement group per island (one bundle holding its CPUs and
accelerators), so an island's resources come and go as a unit and are released with it.

Islands and their groups are named and detached: they belong to the run, not to the
coordinator process, so a coordinator that crashes and restarts finds its islands still
alive (inner optimizer state intact) and re-attaches to them by name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import (PlacementGroup, get_placement_group, placement_group,
                                      placement_group_table, remove_placement_group)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.config import RunConfig
from workers.island import IslandSpec
from workers.island_actor import RayIsland
from workers.island_group import GroupIsland


NAMESPACE = "archipelago"


def island_name(run_id: str, index: int) -> str:
    return f"archipelago-{run_id}-island-{index}"


class PlacementError(RuntimeError):
    """The cluster cannot provide an island's resources in time."""


@dataclass
class IslandHandle:
    index: int
    actor: Any
    group: PlacementGroup


def island_spec(cfg: RunConfig, index: int, start_step: int = 0) -> IslandSpec:
    return IslandSpec(index=index, num_islands=cfg.islands.count, seed=cfg.seed,
                      task_factory=cfg.task.factory, task_kwargs=dict(cfg.task.kwargs), inner=cfg.inner,
                      total_inner_steps=cfg.total_inner_steps, threads=cfg.island_threads,
                      slowdown=cfg.islands.slowdown(index), codec=cfg.compression.codec,
                      chunk=cfg.compression.chunk, num_shards=cfg.num_shards, start_step=start_step,
                      rewarmup_steps=cfg.elastic.join_rewarmup_steps if start_step else 0,
                      coordinator_shards=cfg.coordinator.shards)


def bundle(cfg: RunConfig) -> dict[str, float]:
    """One island worker's resources: its CPUs and accelerators (an island has `islands.workers`)."""
    out = {"CPU": cfg.islands.cpus}
    if cfg.islands.gpus:
        out["GPU"] = cfg.islands.gpus
    return out


def island_bundle(cfg: RunConfig) -> dict[str, float]:
    """A whole island's resources as one bundle: what a node must offer to host it (what
    the autoscaler is asked for, so it adds nodes that fit an island's STRICT_PACK group)."""
    return {k: v * cfg.islands.workers for k, v in bundle(cfg).items()}


def request_group(cfg: RunConfig, index: int, run_id: str) -> PlacementGroup:
    """Ask for an island's resources (one bundle per worker, all on one node); returns at
    once. On an autoscaling cluster a pending group is what makes the autoscaler add a node."""
    return placement_group([bundle(cfg)] * cfg.islands.workers, strategy="STRICT_PACK",
                           name=island_name(run_id, index), lifetime="detached")


def start_island(cfg: RunConfig, index: int, run_id: str, group: PlacementGroup, start_step: int = 0) -> IslandHandle:
    """Start the island inside its (ready) placement group: one actor, or with
    `islands.workers` = N a group of N whose rank 0 is the actor the coordinator talks to
    (the others live and die with the group; `describe` answers once the group formed)."""
    spec = island_spec(cfg, index, start_step)
    cls = ray.remote(GroupIsland if cfg.islands.workers > 1 else RayIsland)

    def worker(rank: int, **named: Any) -> Any:
        return cls.options(
            namespace=NAMESPACE, lifetime="detached", num_cpus=cfg.islands.cpus, num_gpus=cfg.islands.gpus,
            max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
            **named).remote(spec)

    actor = worker(0, name=island_name(run_id, index))
    if cfg.islands.workers > 1:
        actor.form_group.remote([worker(r) for r in range(1, cfg.islands.workers)])
    return IslandHandle(index, actor, group)


def launch_island(cfg: RunConfig, index: int, run_id: str, timeout_s: float = 120.0) -> IslandHandle:
    """Request, wait for and start one island (at the start of a run)."""
    group = request_group(cfg, index, run_id)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise PlacementError(f"island {index}: no node offers {group.bundle_specs[0]} within {timeout_s:.0f}s "
                             f"(cluster has {ray.available_resources()})")
    return start_island(cfg, index, run_id, group)


def find_island(run_id: str, index: int) -> IslandHandle | None:
    """Re-attach to a live island of this run (after a coordinator restart)."""
    name = island_name(run_id, index)
    try:
        actor = ray.get_actor(name, namespace=NAMESPACE)
        return IslandHandle(index, actor, get_placement_group(name))
    except ValueError:
        return None


def release_island(handle: IslandHandle) -> None:
    ray.kill(handle.actor, no_restart=True)
    remove_placement_group(handle.group)


def release_run(run_id: str) -> None:
    """Kill every island actor and group of a run (the driver's cleanup, whatever happened)."""
    prefix = f"archipelago-{run_id}-island-"
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == NAMESPACE and actor["name"].startswith(prefix):
            try:
                ray.kill(ray.get_actor(actor["name"], namespace=NAMESPACE), no_restart=True)
            except ValueError:
                pass
    for pg_id, info in placement_group_table().items():
        if info.get("name", "").startswith(prefix) and info.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
