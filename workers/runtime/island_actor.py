"""The island as a Ray actor: a thin shell over `Island` (or, for an island of several
workers, `GroupIsland`) with what only makes sense under Ray. With a sharded coordinator
the global parameters arrive as S references (one per shard, fetched together) and the
pseudo-gradient leaves as S objects in this island's object store, so each shard pulls
its own slice from here and no single process relays the whole vector.

The shell imports neither torch nor the island runtime: it builds its island in the
actor's own process. The command starts a new run's islands (`prestart_islands`), and
an actor class that subclassed `Island` pulled torch into the command before it could
start anything (0.8 s of its start-up, `bench startup`).

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
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import ray

from ..wire.messages import RoundResult, Sliced, WorkOrder
from .island_spec import IslandSpec
from .log_context import tag_records

if TYPE_CHECKING:
    from ..wire.sync import Change
    from .island import Island
    from .island_group import GroupIsland

log = logging.getLogger(__name__)


def _orphan_watch(coordinator: str, namespace: str, group: str, orphan_after_s: float, poll_s: float) -> None:
    """Release the island once its coordinator's name has been gone `orphan_after_s`. A name
    table that cannot be read (Ray's GCS down: a head restarting, with GCS fault tolerance)
    says nothing either way: the watch goes on (before, the error ended its thread, and an
    island outliving the outage was never released). Should the GCS not come back, the
    node's raylet ends its workers at its own reconnect timeout."""
    missing_since: float | None = None
    unreadable = False
    while True:
        time.sleep(poll_s)
        try:
            present = _named_actor_exists(coordinator, namespace)
        except Exception as err:  # Ray's errors for an unreachable GCS are several types
            if not unreadable:
                log.warning("Ray's actor names cannot be read (%s): still watching for %s", err, coordinator)
            unreadable = True
            continue
        unreadable = False
        if present:  # a restarting coordinator keeps its name
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


def whole_params(params: Any) -> np.ndarray | None:
    """The global parameters, fetched here, in the round: from one object or from S shards'
    slices (fetched together), or an array already in hand. The pool passes references
    inside a list, which Ray does not resolve before the call: Ray resolves a call's
    top-level arguments before the actor runs it and, the actor's queue being in order,
    before it answers any later call — a heartbeat's `identity` included. A download longer
    than the hang floor then looked like silence (seen on the testbed at 2.5 Mbit/s: an
    island released as hung while its bytes moved); fetched here, its heartbeats go on and
    report its card's bytes (`card.py`)."""
    if isinstance(params, list):
        if not params:  # none sent: the order's changes suffice
            return None
        parts = ray.get(params)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
    return params


def fetched(changes: list[Any]) -> tuple[Change, ...]:
    """The order's downlink changes, fetched here (as `whole_params`, for the same reason)."""
    return tuple(ray.get(changes)) if changes else ()


CONTROL = "control"  # the concurrency group of calls answered while a round is in flight
STATE = "state"  # the wait for an inner-state write: minutes at times, never in `control`'s way


def island_actor_class() -> Any:
    """`IslandActor` as a Ray actor class with its concurrency groups: Ray refuses a class
    whose methods name a group the actor class does not declare."""
    return ray.remote(concurrency_groups={CONTROL: 1, STATE: 1})(IslandActor)  # type: ignore[call-overload]


class IslandActor:
    """One island worker. Rounds run one at a time (Ray's default group); `attach` and
    `identity` run in the `control` group, beside a round in flight, so a restarted
    coordinator re-attaches at once instead of waiting behind a round that may last
    minutes (and giving up on the island); so does `stop`, a preemption notice the round
    reads before its next step. `grouped`: a worker of an island of several
    (`islands.workers`), which rank 0 forms with `form_group`."""

    def __init__(self, spec: IslandSpec, grouped: bool = False) -> None:
        if spec.run_id is not None:
            tag_records(spec.run_id)
        if grouped:
            from .island_group import GroupIsland

            self.island: Island = GroupIsland(spec)
        else:
            from .island import Island

            self.island = Island(spec)

    @ray.method(concurrency_group=CONTROL)
    def attach(self) -> dict[str, Any]:
        return self.island.attach()

    @ray.method(concurrency_group=CONTROL)
    def identity(self) -> dict[str, Any]:
        return self.island.identity()

    @ray.method(concurrency_group=CONTROL)
    def stop(self, ticket: int, within_s: float | None = None, after_steps: int | None = None) -> None:
        """A preemption notice for the work `ticket`, beside it (`Island.stop`)."""
        self.island.stop(ticket=ticket, within_s=within_s, after_steps=after_steps)

    @ray.method(concurrency_group=STATE)
    def written(self) -> None:
        """Once its inner state being written (if any) has ended: asked before a checkpoint
        names the file and before the island is killed at the end of a run (beside a round
        that may be stuck, and in a group of its own: a preemption notice in `control` is
        not held behind a write of minutes)."""
        self.island.written()

    def describe(self) -> dict[str, Any]:
        return self.island.describe()

    def watch(self, coordinator: str, namespace: str, group: str, orphan_after_s: float, poll_s: float = 2.0) -> None:
        """Release this island (its placement group, `group`) once `coordinator` has been
        gone for `orphan_after_s`; returns at once (a daemon thread watches)."""
        args = (coordinator, namespace, group, orphan_after_s, poll_s)
        threading.Thread(target=_orphan_watch, args=args, daemon=True, name="orphan-watch").start()

    def rejoin(self, spec: IslandSpec) -> dict[str, Any]:
        return self.island.rejoin(spec)

    def run(self, order: WorkOrder, params: Any, changes: list[Any]) -> RoundResult | tuple[Any, ...]:
        """`params`: references to the global parameters (`whole_params`); `changes`: to the
        order's downlink changes, each put once by the coordinator (the order itself travels
        without them); both fetched here. A streaming order answers at its send point and
        trains its τ steps after (`order_steps.py`)."""
        carried = fetched(changes)
        if carried:
            order = dataclasses.replace(order, changes=carried)
        result = self.island.run(order, whole_params(params), detach_tail=True)
        shards = self.island.spec.coordinator_shards
        if shards == 1:
            return result
        # sliced: the parts are this call's other return values (the pool asks for 1 + S),
        # so their owner is the caller, not this process: a part an island put itself died
        # with it, and a drain or a kill after its result ended the run at the close
        # (`OwnerDiedError` in the slices). Returned, they outlive it on its node's store.
        if not isinstance(result.payload, Sliced):  # no parts (a work stopped before its first step)
            return (result, *([None] * shards))
        head = dataclasses.replace(result, payload=Sliced(parts=()), sent_bytes=result.nbytes)
        return (head, *result.payload.parts)

    def hold(self, order: WorkOrder, params: Any, changes: list[Any]) -> None:
        """A hot spare kept current (`Island.hold`); its arguments fetched here, as `run`'s."""
        carried = fetched(changes)
        if carried:
            order = dataclasses.replace(order, changes=carried)
        self.island.hold(order, whole_params(params))

    # -- an island of several workers: rank 0 forms the group and drives the others ---------
    def form_group(self, followers: list[Any]) -> None:
        cast("GroupIsland", self.island).form_group(followers)

    def join_group(self, address: str, rank: int, world: int) -> None:
        cast("GroupIsland", self.island).join_group(address, rank, world)

    def follow(self, order: WorkOrder, params: np.ndarray) -> None:
        cast("GroupIsland", self.island).follow(order, params)
