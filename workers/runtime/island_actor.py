"""The island as a Ray actor: `Island` plus what only makes sense under Ray. With a
sharded coordinator the global parameters arrive as S references (one per shard, fetched
together) and the pseudo-gradient leaves as S objects in this island's object store, so
each shard pulls its own slice from here and no single process relays the whole vector.

Islands are detached (they outlive a coordinator that Ray restarts), so each watches its
coordinator: if the coordinator's name is gone for `orphan_after_s` — the driver was
SIGKILLed, or the coordinator ran out of restarts — the island removes its own placement
group, which ends it and its group, and gives its node back to the autoscaler."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

import numpy as np
import ray

from workers.runtime.island import Island
from workers.runtime.island_spec import IslandSpec
from workers.wire.messages import RoundResult, Sliced, WorkOrder

log = logging.getLogger(__name__)


def _orphan_watch(coordinator: str, namespace: str, group: str, orphan_after_s: float, poll_s: float) -> None:
    missing_since: float | None = None
    while True:
        time.sleep(poll_s)
        if _named_actor_exists(coordinator, namespace):  # a restarting coordinator keeps its name
            missing_since = None
            continue
        missing_since = missing_since if missing_since is not None else time.monotonic()
        if time.monotonic() - missing_since >= orphan_after_s:
            log.warning("coordinator %s gone for %.0fs: releasing island %s", coordinator, orphan_after_s, group)
            from ray.util.placement_group import get_placement_group, remove_placement_group

            try:
                remove_placement_group(get_placement_group(group))
            finally:
                os._exit(0)


def _named_actor_exists(name: str, namespace: str) -> bool:
    """Whether an actor of that name lives, asked of Ray's name table. Not `ray.get_actor`:
    building a handle imports the actor's class module in this process, and the
    coordinator's pulls the engine, the run config and their imports into every island
    (0.13 s of CPU each, measured; no change in `bench startup` within its noise)."""
    return any(
        a["name"] == name and a["namespace"] == namespace for a in ray.util.list_named_actors(all_namespaces=True)
    )


def whole_params(params: Any) -> np.ndarray:
    """The global parameters, from one array or from S shards' slices (fetched together)."""
    return np.concatenate(ray.get(list(params))) if isinstance(params, list) else params


CONTROL = "control"  # the concurrency group of calls answered while a round is in flight


def actor_class(cls: type) -> Any:
    """`cls` (an island class) as a Ray actor class with its `control` concurrency group:
    Ray refuses a class whose methods name a group the actor class does not declare."""
    return ray.remote(concurrency_groups={CONTROL: 1})(cls)  # type: ignore[call-overload]


class RayIsland(Island):
    """Rounds run one at a time (Ray's default group); `attach` runs in the `control`
    group, beside a round in flight, so a restarted coordinator re-attaches at once instead
    of waiting behind a round that may last minutes (and giving up on the island)."""

    # (Ray's typing of `ray.method` makes each a remote method, not the override it is)
    @ray.method(concurrency_group=CONTROL)
    def attach(self) -> dict[str, Any]:  # type: ignore[override]
        return super().attach()

    @ray.method(concurrency_group=CONTROL)
    def identity(self) -> dict[str, Any]:  # type: ignore[override]
        return super().identity()

    def watch(self, coordinator: str, namespace: str, group: str, orphan_after_s: float, poll_s: float = 2.0) -> None:
        """Release this island (its placement group, `group`) once `coordinator` has been
        gone for `orphan_after_s`; returns at once (a daemon thread watches)."""
        args = (coordinator, namespace, group, orphan_after_s, poll_s)
        threading.Thread(target=_orphan_watch, args=args, daemon=True, name="orphan-watch").start()

    def rejoin(self, spec: IslandSpec) -> dict[str, Any]:
        """Taken over by a pool as the island `spec` describes; answers as `describe`. An
        island started for this very spec that has not trained yet (the command starts a
        new run's islands while the coordinator's process starts) is kept as it is; any
        other is renewed (`Island.reset`)."""
        if spec != self.spec or self.inner_steps_done or self.held is not None:
            self.reset(spec)
        return self.describe()

    def run(self, order: WorkOrder, params: Any) -> RoundResult:
        result = super().run(order, whole_params(params))
        if not isinstance(result.payload, Sliced):
            return result
        refs = Sliced(parts=tuple(ray.put(p) for p in result.payload.parts))
        return dataclasses.replace(result, payload=refs, sent_bytes=result.nbytes)
