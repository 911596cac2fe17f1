"""A simulated fleet on Ray: the islands really train as actors, and the fleet's prices
(its links, the head's card and step: `network.py`) are charged on one of two clocks
(`simulation.clock`). On the virtual clock (`simulation.virtual_step_s`) nothing sleeps, so
a fleet's speeds and links are measured exactly on a contended machine. On the real clock
the islands train at their own pace and every price is waited for, so a run's wall time
holds its links as a real fleet's does: what a benchmark of hidden communication (CO2,
Streaming DiLoCo) times. The Ray pool knows nothing of either: a subclass keeps the clock,
and the coordinator is handed it as its pool (`simulated_pool`, `run_simulated`)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import ray

from archipelago.orchestrator.bench.simulation.config import Clock, SimulationConfig
from archipelago.orchestrator.bench.simulation.network import Network
from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.engine.pool import Done, PoolEvent, Progress
from archipelago.orchestrator.runtime.island_pool import RayIslandPool
from archipelago.workers.wire.messages import WorkOrder


class VirtualClockPool(RayIslandPool):
    """Island i's inner step takes `virtual_step_s × slowdown[i]` simulated seconds and a
    download its link's; results are taken in the order of their simulated finish, once
    they have really finished (work due later waits its turn even if it is done), and the
    clock moves to each finish. Nothing sleeps for simulated time."""

    def __init__(self, cfg: RunConfig, run_id: str, coordinator: str | None = None, *, sim: SimulationConfig) -> None:
        super().__init__(cfg, run_id, coordinator)
        self.sim = sim
        self.network: Network | None = None
        self.vt = 0.0
        self.finish: dict[Any, float] = {}  # object ref -> its simulated finish
        self.begun: dict[Any, float] = {}  # object ref -> when its steps begin (after its download)
        self.counted: dict[int, int] = {}  # heartbeats: each island's steps of finished work
        self.sends: dict[Any, int] = {}  # object ref -> the steps before its pseudo-gradient is taken

    def _listen(self) -> None:
        """No thread: heartbeats are read off the virtual clock (`_heartbeats`)."""
        return None

    def now(self) -> float:
        return self.vt

    def transfers(self, numel: int) -> Network:
        self.network = Network(self.cfg, self.sim, numel)
        return self.network

    def sleep_until(self, t: float) -> None:
        self.vt = max(self.vt, t)

    def dispatch(self, order: WorkOrder, params: Any, changes: tuple[Any, ...] = ()) -> Any:
        """The link's delay is simulated time too: the island does not wait for it."""
        ref = super().dispatch(order, params, changes)
        self.begun[ref] = self.network.arrival(order.island, self.vt) if self.network is not None else self.vt
        self.finish[ref] = self.begun[ref] + self.sim.virtual_seconds(order.island, order.steps)
        self.sends[ref] = order.send_after if order.send_after and order.send_after < order.steps else order.steps
        return ref

    def stop(self, island: int, ticket: int, within_s: float | None) -> None:
        """On the virtual clock the steps that fit are counted here — those begun by now
        and those that end within `within_s` — and the island is told the count (its own
        clock runs at another pace); its result is due when the last of them ends. An
        island already past the count in real time stops at its next step: its result
        reports the steps it took."""
        ref = next((r for r, (t, _) in self.work.items() if t == ticket), None)
        handle = self.handles.get(island)
        if ref is None or handle is None:
            return
        step = self.sim.virtual_seconds(island, 1)
        begun = math.ceil(max(0.0, self.vt - self.begun[ref]) / step - 1e-9)
        fits = 0 if within_s is None else math.floor((self.vt + within_s - self.begun[ref]) / step + 1e-9)
        keep = max(begun, fits)
        if keep >= self.sends[ref]:
            return
        self.finish[ref] = self.begun[ref] + keep * step
        handle.actor.stop.remote(ticket, None, keep)

    def release(self, island: int) -> None:
        for ref in [r for r, (_, i) in self.work.items() if i == island]:
            self.finish.pop(ref, None)
            self.begun.pop(ref, None)
            self.sends.pop(ref, None)
        self.counted.pop(island, None)
        super().release(island)

    def _results(self, timeout: float, wake: float | None) -> list[PoolEvent]:
        """The work that finishes first on the virtual clock; the clock moves to its
        finish, or to `wake` if that comes first (a step due on time, with nothing arriving)."""
        ref = min(self.work, key=lambda r: self.finish[r]) if self.work else None
        if wake is not None and (ref is None or self.finish[ref] > wake):
            self.vt = max(self.vt, wake)
            return []
        if ref is None:
            self._idle(timeout)
            return []
        if not ray.wait([ref], timeout=timeout)[0]:
            return []
        ticket, island = self.work.pop(ref)
        at = self.finish.pop(ref)
        self.begun.pop(ref, None)
        self.sends.pop(ref, None)
        self.vt = max(self.vt, at)
        event = self._fetch(ref, ticket, island)
        if isinstance(event, Done):
            r, sim = event.result, self.sim
            timed = dataclasses.replace(
                r,
                finished_at=at,
                compute_s=sim.virtual_seconds(island, r.steps),
                tail_s=sim.virtual_seconds(island, r.tail_steps),
            )
            event = Done(ticket=ticket, island=island, result=timed)
            self.counted[island] = self.counted.get(island, 0) + r.steps
        return [event]

    def _heartbeats(self) -> list[PoolEvent]:
        """With `elastic.hang_after_steps`, each working island's steps as the simulated
        clock has them, after the results moved it (the islands' real steps say nothing of
        simulated time): a jump of the clock to the next finish is never a stall."""
        if self.cfg.elastic.hang_after_steps is None:
            return []
        beats: list[PoolEvent] = []
        for ref, (ticket, island) in self.work.items():
            step = self.sim.virtual_seconds(island, 1)
            done = int(max(0.0, self.vt - self.begun[ref]) / step) if step > 0 else 0
            beats.append(
                Progress(
                    island=island, steps=self.counted.get(island, 0) + done, work_steps=done, ticket=ticket, at=self.vt
                )
            )
        return beats

    def _speed(self, island: int, info: dict[str, Any]) -> float | None:
        """Known exactly on the virtual clock."""
        return 1.0 / self.sim.virtual_seconds(island, 1)


class RealTimeLinkPool(RayIslandPool):
    """The fleet's prices in real time: a work is handed to its island only once its
    download is in (the actor call held until then, and with it any refresh asked after
    it: an island takes its calls in order), and the engine waits for each result's upload
    and each step's head time on the real clock (`Network` gives it `delivered_at` and
    `published_at`, as on the virtual clock). Islands train at their own pace."""

    def __init__(self, cfg: RunConfig, run_id: str, coordinator: str | None = None, *, sim: SimulationConfig) -> None:
        super().__init__(cfg, run_id, coordinator)
        self.sim = sim
        self.network: Network | None = None
        # island -> its calls held until their download is in, in the order they were asked:
        # (when, the Ray pool's call — a work's dispatch or a refresh — with its arguments)
        self.held: dict[int, list[tuple[float, Callable[[], Any]]]] = {}

    def transfers(self, numel: int) -> Network:
        self.network = Network(self.cfg, self.sim, numel)
        return self.network

    def dispatch(self, order: WorkOrder, params: Any, changes: tuple[Any, ...] = ()) -> Any:
        now = self.now()
        at = self.network.arrival(order.island, now) if self.network is not None else now
        if at <= now and not self.held.get(order.island):
            return super().dispatch(order, params, changes)
        self.held.setdefault(order.island, []).append((at, functools.partial(super().dispatch, order, params, changes)))
        return None

    def refresh(self, order: WorkOrder, params: Any, changes: tuple[Any, ...] = ()) -> None:
        if queue := self.held.get(order.island):
            queue.append((queue[-1][0], functools.partial(super().refresh, order, params, changes)))
        else:
            super().refresh(order, params, changes)

    def stop(self, island: int, ticket: int, within_s: float | None) -> None:
        """A work still on its way is handed over first, so the stop finds it."""
        self._hand(island, until=math.inf)
        super().stop(island, ticket, within_s)

    def release(self, island: int) -> None:
        self.held.pop(island, None)
        super().release(island)

    def poll(self, timeout: float, wake: float | None = None) -> list[PoolEvent]:
        """Hands over the calls whose download is in, and waits no longer than the next."""
        now = self.now()
        for island in list(self.held):
            self._hand(island, until=now)
        due = min((q[0][0] for q in self.held.values() if q), default=math.inf)
        return super().poll(max(0.0, min(timeout, due - now)), wake)

    def _hand(self, island: int, *, until: float) -> None:
        queue = self.held.get(island, [])
        while queue and queue[0][0] <= until:
            queue.pop(0)[1]()
        if not queue:
            self.held.pop(island, None)


def simulated_pool(sim: SimulationConfig) -> Callable[[RunConfig, str, str | None], RayIslandPool]:
    """The coordinator's pool factory for a run on the fleet `sim` on its clock (picklable:
    the coordinator is a Ray actor)."""
    return functools.partial(RealTimeLinkPool if sim.clock == Clock.REAL else VirtualClockPool, sim=sim)


def run_simulated(cfg: RunConfig, sim: SimulationConfig, **options: Any) -> dict[str, Any]:
    """`cfg` run to the end on Ray as `archipelago run` runs it, its islands on the fleet
    `sim` (`driver.run`'s options); its summary. Codecs left `auto` are chosen for the
    simulated fleet's links (`planned_head`), not this machine's."""
    from archipelago.orchestrator.bench.simulation.config import planned_head
    from archipelago.orchestrator.runtime.driver import run

    return run(planned_head(cfg, sim), pool=simulated_pool(sim), ablation=sim.ablation(), **options)
