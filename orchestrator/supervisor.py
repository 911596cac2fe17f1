"""Membership changes while a run goes on: joins, drains, replacement of dead islands.

Requests (from the control plane, tests, or the coordinator itself) go into a
thread-safe queue and take effect at the next round boundary (`tick`), so a change never
tears a round in half. The supervisor keeps the number of live islands at `target`:
it asks for a placement group per missing island without blocking the run (on an
autoscaling cluster a pending group is what brings a node up), starts the actor once the
group is placed, and admits the island when it reports ready.

A newcomer receives the current global parameters with its first round; its fresh
inner optimizer follows the run's learning-rate schedule from the run's current inner
step, ramping up over `elastic.join_rewarmup_steps`, and its first pseudo-gradient is
weighted by `elastic.join_weight` — together these keep a join from causing a loss spike.
"""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from orchestrator.launcher import IslandHandle, island_bundle, release_island, request_group, start_island

if TYPE_CHECKING:
    from orchestrator.coordinator import Coordinator


@dataclass
class _Pending:
    index: int
    group: PlacementGroup
    placed_ref: Any  # group.ready() starts a task each call: keep the one ref
    since: float
    handle: IslandHandle | None = None
    ready_ref: Any = None


class Supervisor:
    def __init__(self, co: "Coordinator", target: int) -> None:
        self.co = co
        self.target = target
        self.requests: queue.Queue = queue.Queue()
        self.pending: dict[int, _Pending] = {}
        self.requested_target: int | None = None

    # -- thread-safe requests ----------------------------------------------------------
    def set_target(self, n: int) -> int:
        e = self.co.cfg.elastic
        if not e.min_islands <= n <= e.max_islands:
            raise ValueError(f"target {n} is outside [elastic.min_islands, elastic.max_islands] = "
                             f"[{e.min_islands}, {e.max_islands}]")
        self.requests.put(("target", n))
        return n

    def drain(self, island: int) -> None:
        """Ask `island` to leave; an island still joining is cancelled instead."""
        if island not in self.co.members.islands and island not in self.pending:
            raise KeyError(f"no island {island}")
        self.requests.put(("drain", island))

    # -- at round boundaries (the loop's thread) ---------------------------------------------
    def live(self) -> list[int]:
        return [i for i, s in self.co.members.islands.items() if s.state in ("training", "late")]

    def tick(self, busy: set[int] | None = None) -> None:
        busy = busy or set()
        while not self.requests.empty():
            kind, value = self.requests.get_nowait()
            if kind == "target":
                self.target = value
                self.co.events.add("target", None, target=value)
            elif kind == "drain" and self._start_drain(value):
                self.target = max(0, self.target - 1)  # a drained island is not replaced
        self._request_resources()
        surplus = len(self.live()) + len(self.pending) - self.target
        for i in sorted(self.live(), reverse=True)[:max(0, surplus)]:
            self._start_drain(i)
        for _ in range(max(0, -surplus)):
            self._request()
        self._admit()
        for i, s in list(self.co.members.islands.items()):
            if s.state == "draining" and (i not in busy or self.co.cfg.elastic.drain == "abandon"):
                self._release(i, "drained")

    def _request_resources(self) -> None:
        """Tell the (KubeRay) autoscaler which island bundles the run wants, so it adds nodes
        on scale-up and, once the request is lowered, removes idle nodes on scale-down."""
        if self.requested_target == self.target:
            return
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[island_bundle(self.co.cfg)] * self.target)
        self.requested_target = self.target
        self.co.events.add("resources_requested", None, bundles=self.target, bundle=island_bundle(self.co.cfg))

    def _start_drain(self, island: int) -> bool:
        """Start draining (or cancel a join); False if the island is already gone."""
        pending = self.pending.pop(island, None)
        if pending is not None:
            if pending.handle is not None:
                release_island(pending.handle)
            else:
                remove_placement_group(pending.group)
            self.co.events.add("join_cancelled", island)
            return True
        stats = self.co.members.islands.get(island)
        if stats is None or stats.state not in ("training", "late"):
            return False
        self.co.members.mark(island, "draining")
        self.co.events.add("drain", island, policy=self.co.cfg.elastic.drain)
        return True

    def _release(self, island: int, state: str) -> None:
        self.co.members.mark(island, state)
        self.co.overdue.pop(island, None)
        handle = self.co.handles.pop(island, None)
        if handle is not None:
            release_island(handle)
        self.co.events.add("released", island, state=state)

    def _request(self) -> None:
        known = set(self.co.members.islands) | set(self.pending)
        index = max(known, default=-1) + 1
        group = request_group(self.co.cfg, index, self.co.run_id)
        self.pending[index] = _Pending(index, group, group.ready(), time.time())
        self.co.events.add("requested", index)

    def _admit(self) -> None:
        co = self.co
        for i, p in list(self.pending.items()):
            if p.handle is None:
                if ray.wait([p.placed_ref], timeout=0)[0]:
                    start = co.completed_steps // max(1, len(self.live()))
                    p.handle = start_island(co.cfg, i, co.run_id, p.group, start_step=start)
                    p.ready_ref = p.handle.actor.describe.remote()
                elif time.time() - p.since > co.cfg.elastic.placement_timeout_s:
                    remove_placement_group(p.group)
                    del self.pending[i]
                    co.events.add("join_failed", i, reason="no resources within elastic.placement_timeout_s")
                continue
            if ray.wait([p.ready_ref], timeout=0)[0]:
                del self.pending[i]
                try:
                    info = ray.get(p.ready_ref)
                except ray.exceptions.RayError as err:
                    release_island(p.handle)
                    co.events.add("join_failed", i, reason=str(err).splitlines()[-1])
                    continue
                co.handles[i] = p.handle
                co.members.add(i, f"{info['host']}:{info['device']}", joined_version=co.server.version)
                co.events.add("join", i, node=info["host"], device=info["device"], version=co.server.version)
