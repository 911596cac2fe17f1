"""Coordinator slices as Ray actors, spread over the cluster's nodes: each pulls its part
of the islands' pseudo-gradients straight from the islands' object stores and publishes
its part of the new parameters for the islands to pull, so no single process relays the
whole vector."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import ray

from ..config import RunConfig
from ..engine.step.rules import outer_rule
from ..engine.step.slices import OuterSlice, SliceStats, copy_kept
from ..engine.types import SliceLost
from .names import NAMESPACE, slice_name


class RemoteOuterSlice(OuterSlice):
    def __init__(self, cfg: RunConfig, bounds: tuple[int, int], params: np.ndarray) -> None:
        super().__init__(outer_rule(cfg), bounds, params, cfg.coordinator.threads or 1, copy_kept(cfg))

    def inspect(
        self, key: int, parts: list[tuple[int, Any]], weights: dict[int, float], scale: float = 1.0
    ) -> list[SliceStats]:
        """The payloads arrive as references (nested, so Ray leaves them to us): one
        `ray.get` fetches all of this slice's parts at once, island to slice directly."""
        payloads = ray.get([p for _, p in parts])
        return super().inspect(key, [(i, p) for (i, _), p in zip(parts, payloads)], weights, scale)


class ActorSlice:
    """A slice actor answering `OuterSlice`'s methods with futures (`RaySlices.gather`
    waits): each method called here is the actor's of that name, sent with `.remote`."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):  # not a slice's method (copy, pickle and the like ask these)
            raise AttributeError(method)
        return getattr(self.actor, method).remote


class RaySlices:
    """`SliceCalls` over the slice actors. A slice that dies (its node was lost) takes its
    part of the global state with it: `SliceLost` is raised and the coordinator restarts
    from its last checkpoint, as after any coordinator failure."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors
        self.slices = [ActorSlice(a) for a in actors]

    def gather(self, answers: list[Any]) -> list[Any]:
        try:
            return ray.get(answers)
        except ray.exceptions.RayActorError as err:
            raise SliceLost(f"coordinator slice lost ({type(err).__name__})") from err
        except ray.exceptions.RayTaskError as err:
            # an island's part lost with its node between its result and the close (its owner,
            # the coordinator, lives: `IslandActor.run`): the slices' round cannot close, and
            # a restart from the last checkpoint is what recovers it, as for a lost slice
            if isinstance(err.cause, ray.exceptions.ObjectLostError):
                raise SliceLost(f"an island's part was lost ({type(err.cause).__name__})") from err
            raise

    def params(self) -> list[Any]:
        return [a.params.remote() for a in self.actors]

    def changes(self, version: int) -> list[tuple[Any, Any]]:
        return [tuple(a.change.options(num_returns=2).remote(version)) for a in self.actors]

    def copies(self) -> list[Any]:
        return [a.copy.remote() for a in self.actors]

    def fetch(self, slices: list[Any]) -> list[np.ndarray]:
        return self.gather(slices)

    def release(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


def start_slices(cfg: RunConfig, params: np.ndarray, bounds: list[tuple[int, int]], run_id: str) -> RaySlices:
    """S slice actors (no CPU reserved: their work is a few vector ops per step) owned by
    the coordinator, so they go when it goes and a restarted coordinator rebuilds them from
    its checkpoint. Each takes a unit of `coordinator.slice_resource` where it is set (the
    slice nodes offer one each: a node of its own per slice, the head's card and memory
    spared), else Ray spreads them. Named `archipelago-<run>-slice-<k>-<id>` (the id differs
    per coordinator incarnation) so operators find them in `ray list actors`."""
    incarnation = uuid.uuid4().hex[:6]
    resource = cfg.coordinator.slice_resource
    placement: dict[str, Any] = {"resources": {resource: 1}} if resource else {"scheduling_strategy": "SPREAD"}
    actors = [
        ray.remote(RemoteOuterSlice)
        .options(
            name=slice_name(run_id, k, incarnation),
            namespace=NAMESPACE,
            num_cpus=0,
            max_concurrency=1,
            **placement,
        )
        .remote(cfg, b, params[b[0] : b[1]])
        for k, b in enumerate(bounds)
    ]
    return RaySlices(actors)
