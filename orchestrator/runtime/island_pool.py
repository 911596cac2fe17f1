"""The island pool on Ray (`IslandPool` over `island_actors.py`): islands requested as
named placement groups and actors, work as actor calls, heard back through `ray.wait`.
Placing never blocks the engine: a requested group is polled with the work in flight, and
on an autoscaling cluster a pending group is what brings a node up. A coordinator that
restarts re-attaches to its live islands by name; islands started before the pool asked
for them (by the command, or in the warm start) are adopted. A node Ray is draining (the
autoscaler or KubeRay reclaiming it, a spot instance's notice passed on with `ray
drain-node`) is a preemption notice for the islands on it."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

from archipelago.workers.runtime.island_spec import IslandSpec
from archipelago.workers.wire.messages import RoundResult, SavedState, Sliced, WorkOrder
from archipelago.workers.wire.sync import Change

from ..config import RunConfig
from ..engine.links import INSTANT, Transfers
from ..engine.pool import Done, Failed, Joined, JoinFailed, PoolEvent, Preempting, Unreachable
from ..engine.specs import island_spec
from .heartbeats import Gone, Heartbeats
from .island_actors import (
    IslandHandle,
    find_island,
    island_bundle,
    release_island,
    release_islands,
    request_group,
    run_islands,
    start_island,
)

log = logging.getLogger(__name__)


def carried(params: Any) -> list[Any]:
    """The global parameters' references as an island's call carries them: in a list, which
    Ray does not resolve before the call, so the island fetches them in its round and
    answers its heartbeats meanwhile (`island_actor.whole_params`). None (the changes
    suffice): an empty list."""
    if params is None:
        return []
    return params if isinstance(params, list) else [params]


WRITES_WAIT_S = 300.0  # at most, for the islands' inner-state writes when a run ends (8 GB to a bucket: a minute)


@dataclass
class _Placing:
    index: int
    group: PlacementGroup
    placed_ref: Any  # group.ready() starts a task each call: keep the one ref
    since: float
    spec: IslandSpec
    handle: IslandHandle | None = None
    ready_ref: Any = None
    adopted: bool = False  # its process was started before this pool asked for it


class RayIslandPool:
    def __init__(self, cfg: RunConfig, run_id: str, coordinator: str | None = None) -> None:
        """`coordinator`: the actor name islands watch (default: `run_id`'s coordinator)."""
        self.cfg, self.run_id, self.coordinator = cfg, run_id, coordinator
        self.handles: dict[int, IslandHandle] = {}
        self.placing: dict[int, _Placing] = {}
        self.work: dict[Any, tuple[int, int]] = {}  # object ref -> (ticket, island)
        self.parts: dict[Any, list[Any]] = {}  # a sliced result's ref -> its parts' refs (owned here)
        self.published: tuple[int, Any] | None = None
        self.demanded: int | None = None
        self.adopted: dict[int, IslandHandle] = {}  # started before this pool asked for them (`adopt`)
        self.heartbeats = self._listen()
        self.drains_read_at = -math.inf  # when Ray's draining nodes were last read (on `now`'s clock)
        self.drains_unread = False  # the last read of them failed (said once, at warning)
        self.nodes: dict[int, set[str]] = {}  # island -> the Ray node ids its workers were placed on
        self.noticed: set[int] = set()  # islands whose preemption notice was given
        self.fetched_s: dict[int, float] = {}  # island -> seconds its latest result took to fetch (`_fetch`)

    def _listen(self) -> Heartbeats | None:
        """Heartbeats heard on a thread of their own (`heartbeats.py`), with
        `elastic.hang_after_steps`."""
        elastic = self.cfg.elastic
        return Heartbeats(elastic.progress_every_s) if elastic.hang_after_steps is not None else None

    def transfers(self, numel: int) -> Transfers:
        """A transfer takes the time it takes on the cluster: nothing is added."""
        return INSTANT

    def now(self) -> float:
        """Monotonic; with heartbeats, stopped while the coordinator could not listen."""
        return self.heartbeats.clock.now() if self.heartbeats is not None else time.monotonic()

    def sleep_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))

    def request(
        self, island: int, start_step: int, *, state_folder: str | None = None, restore: SavedState | None = None
    ) -> None:
        spec = island_spec(self.cfg, island, start_step, state_folder=state_folder, restore=restore)
        adopted = self.adopted.pop(island, None)
        if adopted is not None:  # placed already: taken over in its process, it answers as `describe` does
            ready = adopted.actor.rejoin.remote(spec)
            self.placing[island] = _Placing(island, adopted.group, None, self.now(), spec, adopted, ready, True)
            return
        group = request_group(self.cfg, island, self.run_id)
        self.placing[island] = _Placing(island, group, group.ready(), self.now(), spec)

    def reattach(self, island: int) -> str | None:
        handle = find_island(self.run_id, island)
        if handle is None:
            return None
        try:  # answered beside a round in flight (the `control` group): O(1), busy or not
            info = ray.get(handle.actor.attach.remote(), timeout=30)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            release_island(handle)
            return None
        self._placed(island, handle)
        return f"{info['host']}:{info['device']}"

    def survivors(self) -> list[int]:
        return sorted(i for i, (actors, _) in run_islands(self.run_id).items() if actors)

    def sweep(self, keep: set[int]) -> None:
        release_islands(self.run_id, set(run_islands(self.run_id)) - keep - set(self.adopted))

    def cancel(self, island: int) -> None:
        p = self.placing.pop(island, None)
        if p is not None:
            if p.handle is not None:
                release_island(p.handle)
            else:
                remove_placement_group(p.group)
        self.release(island)

    def release(self, island: int) -> None:
        for ref in [r for r, (_, i) in self.work.items() if i == island]:
            del self.work[ref]
            self.parts.pop(ref, None)
        if self.heartbeats is not None:
            self.heartbeats.forget(island)
        self.nodes.pop(island, None)
        self.noticed.discard(island)
        self.fetched_s.pop(island, None)
        handle = self.handles.pop(island, None)
        if handle is not None:
            try:
                release_island(handle)
            except Exception:
                log.debug("island %d was already gone", island)

    def demand(self, islands: int) -> None:
        """Tell the (KubeRay) autoscaler which island bundles the run wants, so it adds nodes
        on scale-up and, once the request is lowered, removes idle nodes on scale-down."""
        if self.demanded == islands:
            return
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[island_bundle(self.cfg)] * islands)
        self.demanded = islands

    def publish(self, version: int, params: Any) -> Any:
        """One `ray.put` per version of a numpy array (zero-copy to read; a sliced
        coordinator's slices are already references)."""
        if isinstance(params, list):
            return params
        return ray.put(params)

    def share(self, change: Change) -> Any:
        """One `ray.put` per change: an order names it (fetched by the island in its round,
        `carried`) instead of carrying a pickled copy per island."""
        return ray.put(change)

    def dispatch(self, order: WorkOrder, params: Any, changes: tuple[Any, ...] = ()) -> Any:
        """Its object reference, as well."""
        handle = self.handles.get(order.island)
        if handle is None:
            raise KeyError(f"island {order.island} is not placed")
        shards = self.cfg.coordinator.slices
        if shards == 1:
            ref = handle.actor.run.remote(order, carried(params), list(changes))
        else:  # the parts as return values of their own, owned here (`IslandActor.run`)
            ref, *parts = handle.actor.run.options(num_returns=1 + shards).remote(order, carried(params), list(changes))
            self.parts[ref] = parts
        self.work[ref] = (order.ticket, order.island)
        return ref

    def stop(self, island: int, ticket: int, within_s: float | None) -> None:
        """Asked in the island's `control` group, beside its round, and not waited for. A
        node is torn down at its deadline with what its object store holds, so the result
        must be off it by then: the island's last step must end within the time the engine
        allows (which prices only the link model) less the time its latest result took
        to fetch (measured) and `elastic.notice_margin_s` for the rest of the way (the
        notice's and the result's own messages, the coordinator's next read)."""
        handle = self.handles.get(island)
        if handle is not None:
            if within_s is not None:
                within_s = max(0.0, within_s - self.fetched_s.get(island, 0.0) - self.cfg.elastic.notice_margin_s)
            handle.actor.stop.remote(ticket, within_s)

    def refresh(self, order: WorkOrder, params: Any, changes: tuple[Any, ...] = ()) -> None:
        """Asked and not waited for: the actor takes it before any work given after it."""
        handle = self.handles.get(order.island)
        if handle is not None:
            handle.actor.hold.remote(order, carried(params), list(changes))

    def poll(self, timeout: float, wake: float | None = None) -> list[PoolEvent]:
        events: list[PoolEvent] = self._placements()
        events += self._results(0 if events else timeout, wake)
        # after the results: a clock they moved is the one reported on
        return events + self._heartbeats() + self._drain_notices()

    def _drain_notices(self) -> list[PoolEvent]:
        """Every `elastic.progress_every_s`, the nodes Ray is draining (each with the time
        it will be taken, if given): a `Preempting` notice, once, for each island with a
        worker on one. Ray's list is read through its state API (`get_draining_nodes`, as
        Ray Serve reads it; not a public API): a Ray without it gives no notices, and the
        island's loss is then a crash."""
        now = self.now()
        if not self.handles or now - self.drains_read_at < self.cfg.elastic.progress_every_s:
            return []
        self.drains_read_at = now
        try:
            from ray._private.state import state

            draining: dict[str, int] = state.get_draining_nodes()
        except (AttributeError, ImportError, ray.exceptions.RayError) as err:
            # said once at warning (preemption notices are off until it reads again), then quietly
            (log.debug if self.drains_unread else log.warning)(
                "Ray's draining nodes could not be read (%s): a drained island's loss is a crash until they can", err
            )
            self.drains_unread = True
            return []
        self.drains_unread = False
        events: list[PoolEvent] = []
        for island, handle in self.handles.items():
            deadlines = [draining[n] for n in self._nodes_of(island, handle) if n in draining]
            if deadlines and island not in self.noticed:
                self.noticed.add(island)
                deadline_ms = min((d for d in deadlines if d), default=0)  # 0: no deadline given
                notice = max(0.0, deadline_ms / 1000 - time.time()) if deadline_ms else None
                log.warning("island %d: its node is being drained (taken in %s s)", island, notice)
                events.append(Preempting(island=island, notice_s=notice))
        return events

    def _nodes_of(self, island: int, handle: IslandHandle) -> set[str]:
        if island not in self.nodes:
            try:
                placed = placement_group_table(handle.group)["bundles_to_node_id"].values()
            except (KeyError, ray.exceptions.RayError):
                return set()
            nodes = {n for n in placed if n}  # a bundle being rescheduled names no node ("") yet
            if not nodes:
                return set()  # asked again next time, not remembered empty
            self.nodes[island] = nodes
        return self.nodes[island]

    def _results(self, timeout: float, wake: float | None) -> list[PoolEvent]:
        """Every result that is in, waiting up to `timeout` for the first (`wake`, a step
        due at that time, needs no reminder here: `timeout` ends before it)."""
        refs = list(self.work)
        if not refs:
            self._idle(timeout)
            return []
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return [self._fetch(ref, *self.work.pop(ref)) for ref in ready]

    def _heartbeats(self) -> list[PoolEvent]:
        """What the heartbeats' thread heard since the last poll (`heartbeats.py`): each
        island's step count, and the death of an island with no work out (a spare's, found
        before it is promoted); an island with work out dies as its result's failure."""
        if self.heartbeats is None:
            return []
        events: list[PoolEvent] = []
        working = {i for _, i in self.work.values()}
        for heard in self.heartbeats.take():
            if not isinstance(heard, Gone):
                events.append(heard)
            elif heard.island in self.handles and heard.island not in working:
                events.append(Failed(ticket=None, island=heard.island, reason=heard.reason))
        return events

    def _placed(self, island: int, handle: IslandHandle) -> None:
        self.handles[island] = handle
        if self.heartbeats is not None:
            self.heartbeats.watch(island, handle.actor)

    def _idle(self, timeout: float) -> None:
        """No work out: wait, looking at placements more often while some are pending."""
        time.sleep(timeout if not self.placing else min(timeout, 0.05))

    def _fetch(self, ref: Any, ticket: int, island: int) -> PoolEvent:
        """The result of `ref`, or the island's failure: any Ray error fetching it (the actor
        died, its code raised, the object was lost or its owner died between `ray.wait` and
        here) is that island's, never the run's; an island Ray could not reach (a partition:
        seen on the testbed a few seconds into a 20-s link cut) lost its work, not its place. The result is stamped with the
        coordinator's arrival time: an island's clock is never trusted."""
        began, parts = time.perf_counter(), self.parts.pop(ref, None)
        try:
            result = ray.get(ref)
        except ray.exceptions.ActorUnavailableError as err:  # a partition: its work is lost, not it
            if (handle := self.handles.get(island)) is not None:  # its round ends at its next step, unwaited
                handle.actor.stop.remote(ticket, 0.0)
            return Unreachable(ticket=ticket, island=island, reason=f"unreachable: {type(err).__name__}")
        except ray.exceptions.RayActorError as err:
            return Failed(ticket=ticket, island=island, reason=f"actor died: {type(err).__name__}")
        except ray.exceptions.RayTaskError as err:
            return Failed(ticket=ticket, island=island, reason=f"raised: {str(err).strip().splitlines()[-1]}")
        except ray.exceptions.RayError as err:
            return Failed(ticket=ticket, island=island, reason=f"result lost: {type(err).__name__}")
        if not isinstance(result, RoundResult):
            return Failed(ticket=ticket, island=island, reason=f"sent a {type(result).__name__}, not a round result")
        if parts is not None and isinstance(result.payload, Sliced):
            result = dataclasses.replace(result, payload=Sliced(parts=tuple(parts)))
        self.fetched_s[island] = time.perf_counter() - began
        return Done(
            ticket=ticket,
            island=island,
            result=dataclasses.replace(result, finished_at=self.now()),
        )

    def _placements(self) -> list[PoolEvent]:
        events: list[PoolEvent] = []
        for i, p in list(self.placing.items()):
            if p.handle is None:
                if ray.wait([p.placed_ref], timeout=0)[0]:
                    try:
                        p.handle = start_island(self.cfg, p.spec, self.run_id, p.group, coordinator=self.coordinator)
                    except (ValueError, ray.exceptions.RayError) as err:  # e.g. its name still taken
                        del self.placing[i]
                        remove_placement_group(p.group)
                        events.append(JoinFailed(island=i, reason=f"could not start: {err}"))
                        continue
                    p.ready_ref = p.handle.actor.describe.remote()
                continue
            if ray.wait([p.ready_ref], timeout=0)[0]:
                del self.placing[i]
                try:
                    info = ray.get(p.ready_ref)
                except ray.exceptions.RayError as err:
                    release_island(p.handle)
                    events.append(JoinFailed(island=i, reason=str(err).strip().splitlines()[-1]))
                    continue
                self._placed(i, p.handle)
                events.append(
                    Joined(
                        island=i,
                        node=f"{info['host']}:{info['device']}",
                        steps_per_s=self._speed(i, info),
                        restored=info.get("inner_state_restored"),
                        startup=info.get("startup"),
                        built_sha256=info.get("built_sha256"),
                        adopted=p.adopted,
                    )
                )
        return events

    def _speed(self, island: int, info: dict[str, Any]) -> float | None:
        """A new island's steps per second: what it probed, if it did."""
        return info.get("steps_per_s")

    def hand_over(self, keep: set[int]) -> dict[int, Any]:
        """Only single-worker islands carry over: an island of N workers is a process group
        whose followers would have to be renewed with it, so it is placed anew."""
        out = {}
        for i in list(self.handles):
            if i in keep and self.cfg.islands.workers == 1:
                out[i] = self.handles.pop(i)
                if self.heartbeats is not None:
                    self.heartbeats.forget(i)
            else:
                self.release(i)
        return out

    def writes_ending(self, islands: list[int]) -> Callable[[float], list[Any]]:
        """(`IslandPool.writes_ending`) The islands are asked now, in their `state` group;
        the wait returns the answers still missing (an island gone answers at once)."""
        refs = [self.handles[i].actor.written.remote() for i in islands if i in self.handles]

        def wait(timeout_s: float) -> list[Any]:
            return ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[1] if refs else []

        return wait

    def _await_writes(self) -> None:
        """Let the islands end the inner-state writes the run's last checkpoint may name
        before they are killed; bounded, so an island that cannot answer does not hold the
        run's end (its state is then lost: a resume gives it fresh moments)."""
        if waiting := self.writes_ending(list(self.handles))(WRITES_WAIT_S):
            log.warning("%d island(s) did not finish writing their inner state in %.0f s", len(waiting), WRITES_WAIT_S)

    def adopt(self, islands: dict[int, Any]) -> None:
        self.adopted.update(islands)

    def adopt_started(self, count: int) -> None:
        """Adopt islands 0..count-1 of this run, found by name (`prestart_islands`)."""
        self.adopt({i: h for i in range(count) if (h := find_island(self.run_id, i)) is not None})

    def close(self) -> None:
        if self.heartbeats is not None:
            self.heartbeats.close()
        self._await_writes()
        for i in list(self.handles):
            self.release(i)
        for i in list(self.placing):
            self.cancel(i)
        for handle in self.adopted.values():
            release_island(handle)
        self.adopted.clear()
