"""Places island actors: one placement group per island (one bundle holding its CPUs and
accelerators), so an island's resources come and go as a unit and are released with it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.config import RunConfig
from workers.island import Island, IslandSpec


class PlacementError(RuntimeError):
    """The cluster cannot provide an island's resources in time."""


@dataclass
class IslandHandle:
    index: int
    actor: Any
    group: PlacementGroup


def island_spec(cfg: RunConfig, index: int) -> IslandSpec:
    return IslandSpec(index=index, num_islands=cfg.islands.count, seed=cfg.seed,
                      task_factory=cfg.task.factory, task_kwargs=dict(cfg.task.kwargs), inner=cfg.inner,
                      total_inner_steps=cfg.total_inner_steps, threads=cfg.island_threads,
                      slowdown=cfg.islands.slowdown(index), codec=cfg.compression.codec,
                      chunk=cfg.compression.chunk, num_shards=cfg.num_shards)


def launch_island(cfg: RunConfig, index: int, timeout_s: float = 120.0) -> IslandHandle:
    bundle = {"CPU": cfg.islands.cpus}
    if cfg.islands.gpus:
        bundle["GPU"] = cfg.islands.gpus
    group = placement_group([bundle], strategy="STRICT_PACK", name=f"archipelago-island-{index}")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise PlacementError(f"island {index}: no node offers {bundle} within {timeout_s:.0f}s "
                             f"(cluster has {ray.available_resources()})")
    actor = ray.remote(Island).options(
        num_cpus=cfg.islands.cpus, num_gpus=cfg.islands.gpus, max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
    ).remote(island_spec(cfg, index))
    return IslandHandle(index, actor, group)


def release_island(handle: IslandHandle) -> None:
    ray.kill(handle.actor, no_restart=True)
    remove_placement_group(handle.group)
