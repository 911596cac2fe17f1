"""Islands as named Ray actors, one placement group each (one bundle per worker,
STRICT_PACK), so an island's resources come and go as a unit and are released with it:
placing, starting, finding, releasing, all by the run's names. Islands and their groups
are detached: they belong to the run, not to the coordinator process, so a coordinator
that crashes and restarts finds its islands still alive (inner optimizer state intact)
and re-attaches to them by name; each watches its coordinator and releases itself once
the run is gone. `prestart_islands` lets the command start a new run's islands beside
its coordinator, which adopts them (`RayIslandPool.adopt`)."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from archipelago.workers.runtime.island_actor import island_actor_class
from archipelago.workers.runtime.island_spec import IslandSpec

from ..config import RunConfig
from ..engine.fleet.island_states import state_folder
from ..engine.specs import island_spec
from ..engine.warm_start import first_phase
from ..logs import emits_json
from .names import NAMESPACE, coordinator_name, island_name


@dataclass
class IslandHandle:
    index: int
    actor: Any
    group: PlacementGroup


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
    return placement_group(
        [bundle(cfg)] * cfg.islands.workers,
        strategy="STRICT_PACK",
        name=island_name(run_id, index),
        lifetime="detached",
    )


def start_island(
    cfg: RunConfig, spec: IslandSpec, run_id: str, group: PlacementGroup, coordinator: str | None = None
) -> IslandHandle:
    """Start the island inside its (ready) placement group: one actor, or with
    `islands.workers` = N a group of N whose rank 0 is the actor the coordinator talks to
    (the others live and die with the group; `describe` answers once the group formed)."""
    index = spec.index
    if emits_json():  # its records then carry the run's id, as the coordinator's do
        spec = dataclasses.replace(spec, run_id=run_id)
    cls = island_actor_class()
    grouped = cfg.islands.workers > 1

    def worker(rank: int, **named: Any) -> Any:
        return cls.options(
            namespace=NAMESPACE,
            lifetime="detached",
            num_cpus=cfg.islands.cpus,
            num_gpus=cfg.islands.gpus,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
            **named,
        ).remote(spec, grouped=grouped)

    actor = worker(0, name=island_name(run_id, index))
    # detached, so it must end itself if the run is gone (a SIGKILLed driver runs no cleanup)
    watched = coordinator or coordinator_name(run_id)
    actor.watch.remote(watched, NAMESPACE, island_name(run_id, index), cfg.elastic.orphan_timeout_s)
    if cfg.islands.workers > 1:
        actor.form_group.remote([worker(r) for r in range(1, cfg.islands.workers)])
    return IslandHandle(index, actor, group)


def prestart_islands(cfg: RunConfig, run_id: str) -> int:
    """Start a new run's first islands from the command, before its coordinator exists,
    so that their processes start (and import torch, and load the task) while the
    coordinator's does: the coordinator's pool adopts them by name (`RayIslandPool.adopt`).
    Returns how many. Islands of several workers are left to the coordinator (their group
    forms when it places them)."""
    phase, phase_id = first_phase(cfg, run_id) or (cfg, run_id)
    if phase.islands.workers != 1:
        return 0
    folder = state_folder(phase, phase_id)
    specs = [island_spec(phase, i, phase.warm_steps, state_folder=folder) for i in range(phase.islands.count)]
    if any(s.version0_file is not None and not Path(s.version0_file).exists() for s in specs):
        # the first run forking from this warm start: its coordinator writes the file the
        # islands build version 0 from, and an island started now would not find it
        return 0
    for i, spec in enumerate(specs):  # the specs the phase's engine asks for (else it renews them)
        start_island(phase, spec, run_id, request_group(phase, i, run_id))
    return phase.islands.count


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


def _index(run_id: str, name: str) -> int | None:
    prefix = island_name(run_id, 0)[:-1]
    rest = name[len(prefix) :] if name.startswith(prefix) else ""
    return int(rest) if rest.isdigit() else None


def run_islands(run_id: str) -> dict[int, tuple[list[str], list[str]]]:
    """Index -> (actor names, placement group ids) of this run's islands that exist."""
    found: dict[int, tuple[list[str], list[str]]] = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == NAMESPACE and (i := _index(run_id, actor["name"])) is not None:
            found.setdefault(i, ([], []))[0].append(actor["name"])
    for pg_id, info in placement_group_table().items():
        if info.get("state") != "REMOVED" and (i := _index(run_id, info.get("name", ""))) is not None:
            found.setdefault(i, ([], []))[1].append(pg_id)
    return found


def release_islands(run_id: str, indices: set[int] | None = None) -> None:
    """Kill the island actors and groups of a run (all, or those of `indices`), by name."""
    for i, (actors, groups) in run_islands(run_id).items():
        if indices is not None and i not in indices:
            continue
        for name in actors:
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        for pg_id in groups:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
