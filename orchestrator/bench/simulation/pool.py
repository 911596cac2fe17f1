"""The island pool of tests and benchmarks: islands as plain `Island` objects of this
process on a virtual clock (compute and the simulated network, `network.py`, advance it;
nothing sleeps),
with faults injected by work order (`Fault`) or in time (`chaos.TimedFault`) — so the
engine's behaviour under crashes, late and NaN islands, joins, drains and restarts is
tested in seconds, and a bench runs many simulated islands on two cores."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from archipelago.orchestrator.bench.simulation.chaos import Strike, TimedFault
from archipelago.orchestrator.bench.simulation.config import ReplacementSpeed, SimulationConfig
from archipelago.orchestrator.bench.simulation.network import Network
from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.engine.pool import Done, Failed, Joined, PoolEvent, Preempting, Progress
from archipelago.orchestrator.engine.specs import island_spec
from archipelago.orchestrator.engine.types import SliceLost
from archipelago.workers.runtime.island import Island
from archipelago.workers.wire.messages import SavedState, Sliced, WorkOrder
from archipelago.workers.wire.sync import Change

DISPATCH_LOG = 4096  # orders the in-process pool remembers


class FaultKind(str, Enum):
    CRASH = "crash"  # the island dies during its n-th work order
    DEAD = "dead"  # the island died before its n-th work order (idle): the order fails at once
    HUNG = "hung"  # the island hung before its n-th work order (idle): it never answers, its count never moves
    LATE = "late"  # its n-th work order takes `seconds` longer
    HANG = "hang"  # its n-th work order never returns
    NAN = "nan"  # its n-th pseudo-gradient is NaN
    RAISE = "raise"  # its code raises during its n-th work order
    MISREPORT = "misreport"  # its n-th result claims tokens on a shard it was not given
    MALFORMED = "malformed"  # its n-th result carries `payload` instead of its pseudo-gradient
    CLOCK = "clock"  # its n-th result says it finished at `seconds` on its own clock
    CORRUPT = "corrupt"  # its n-th work order's full parameters arrive with one byte flipped


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    island: int
    order: int  # 1-based count of the work orders this island was given
    seconds: float = 0.0
    payload: Any = None


@dataclass
class Losses:
    """Island-seconds a fleet lost, by cause, as the pool saw them (`bench fleet`'s
    breakdown of where the time went)."""

    struck: dict[Strike, float] = field(default_factory=lambda: dict.fromkeys(Strike, 0.0))  # work destroyed
    strikes: dict[Strike, int] = field(default_factory=lambda: dict.fromkeys(Strike, 0))  # that hit an island
    undetected: float = 0.0  # a hung island's time from its hang until the engine let it or its work go
    placement: float = 0.0  # islands placed after the start (replacements): `join_s` each
    halted: float = 0.0  # seconds the whole fleet stood still (stop-the-world restarts)
    head_failures: int = 0  # the head's nodes (the coordinator's, its slices') that failed

    def __iadd__(self, other: Losses) -> Losses:
        """Another pool's account added (a run of two phases has a pool each)."""
        for k in Strike:
            self.struck[k] += other.struck[k]
            self.strikes[k] += other.strikes[k]
        self.undetected += other.undetected
        self.placement += other.placement
        self.halted += other.halted
        self.head_failures += other.head_failures
        return self


@dataclass(frozen=True)
class _Frozen:
    """A hung island's next heartbeat: alive, answering in its control thread, with a count
    that no longer moves (as a process stuck in its data or a collective answers on Ray)."""

    island: int
    steps: int
    work_steps: int
    ticket: int


@dataclass(frozen=True)
class _Gone:
    """A preempted island's node is taken: its work `ticket`, if still not delivered, is lost."""

    island: int
    ticket: int


@dataclass(eq=False, kw_only=True)
class _Work:
    """A work order on its way. The island computes it when it is due — a real island's
    result exists only then, and what happens meanwhile (a notice that stops it) shapes it;
    an earlier order of the same island is computed first (`_complete`), as an actor runs
    its calls in turn. `steps_at` and `ends_at` place its steps on the virtual clock."""

    order: WorkOrder
    params: Any
    fault: Fault | None
    step: float  # seconds per inner step at its dispatch
    start: float  # when its first step begins (its download done)
    due: float  # when its result is delivered
    compute: float  # seconds of compute its result reports
    seq: int  # dispatch order
    slowed: tuple[float, float] | None = None  # (from when, factor): a slow-down that struck it
    budget: int | None = None  # a notice stopped it after this many steps
    outcome: Done | Failed | None = None  # computed ahead of its time, for a later order of its island

    @property
    def island(self) -> int:
        return self.order.island

    @property
    def ticket(self) -> int:
        return self.order.ticket

    def _bend(self) -> tuple[float, float]:
        """When its pace changed (a slow-down; never: its start) and the step time after."""
        if self.slowed is None:
            return self.start, self.step
        return max(self.slowed[0], self.start), self.step * self.slowed[1]

    def steps_at(self, t: float) -> float:
        """Steps done by `t` (fractional: the one in progress in part)."""
        bend, after = self._bend()
        return max(0.0, (min(t, bend) - self.start) / self.step + max(0.0, t - bend) / after)

    def ends_at(self, steps: int) -> float:
        """When its `steps`-th step ends."""
        bend, after = self._bend()
        before = (bend - self.start) / self.step
        return self.start + steps * self.step if steps <= before else bend + (steps - before) * after


@dataclass(order=True)
class _Pending:
    at: float
    seq: int
    event: Any = field(compare=False)


class InProcessPool:
    """Islands as plain `Island` objects; work is computed when its result is due, at
    virtual time `download + steps × step_s × slowdown (+ injected delay)`, and delivered
    then."""

    def __init__(
        self,
        cfg: RunConfig,
        sim: SimulationConfig | None = None,
        *,
        step_s: float | None = None,
        faults: list[Fault] | None = None,
        join_s: float = 0.0,
        unplaceable: set[int] | None = None,
        chaos: list[TimedFault] | None = None,
        chaos_seed: int = 0,
        head_failures: list[float] | None = None,
    ) -> None:
        """`sim`: the fleet (none: islands at speed 1 on instant links); `step_s`: seconds
        of an inner step at speed 1 (default `sim.virtual_step_s`). `faults` strike an
        island's n-th work order; `chaos` strikes in time, each fault whichever island (drawn
        with `chaos_seed`) is working when it comes — or, with `sim.strike_idle`, whichever
        island is alive, working or not: a machine fails whether or not it computes, and one
        waiting at a barrier or in data-parallel's all-reduce is struck as often as one
        stepping (`bench fleet`: without it, every strike during an all-reduce passed data-
        parallel by, 12 where its failure rate gave about 138). `head_failures`: when a node
        of the head fails — the coordinator's or a slice's, each taking the coordinator down
        with its part of the global state (`SliceLost`, raised from `poll` at that time: a
        new coordinator resumes from the checkpoint, with the islands where they were)."""
        self.cfg, self.join_s = cfg, join_s
        self.sim = sim or SimulationConfig()
        self.step_s = self.sim.virtual_step_s if step_s is None else step_s
        self.network: Network | None = None  # made when the engine asks for it (`transfers`)
        self.factors: dict[int, float] = {}  # island -> the slowdown of the node it was placed on
        self.freed: deque[float] = deque()  # released islands' nodes' slowdowns, for replacements
        self.noise = np.random.default_rng(chaos_seed + 7919)  # measured speeds' spread
        self.chaos = sorted(chaos or [], key=lambda f: f.at)
        self.head_failures = sorted(head_failures or [])
        self.rng = np.random.default_rng(chaos_seed)
        self.slow: dict[int, tuple[float, float]] = {}  # island -> (factor, until)
        self.faults = list(faults or [])
        self.unplaceable = set(unplaceable or ())  # islands whose placement never succeeds
        self.islands: dict[int, Island] = {}
        self.dead: set[int] = set()
        self.orders: dict[int, int] = {}
        self.t = 0.0
        self._seq = itertools.count()
        self._queue: list[_Pending] = []
        # the newest orders, for tests that inspect them (bounded: a long run's would grow)
        self.dispatched: deque[WorkOrder] = deque(maxlen=DISPATCH_LOG)
        self.demanded: list[int] = []
        self.adopted: dict[int, Island] = {}
        self.steps_done: dict[int, int] = {}  # heartbeats: each island's inner steps in all
        self.losses = Losses()
        self.started: dict[int, float] = {}  # ticket -> when its compute began (what a strike destroys)
        self.hung: dict[int, float] = {}  # island -> when it hung
        self.doomed: dict[int, float] = {}  # island -> when it is gone (a preemption's notice ran out)
        self.beats: dict[int, Progress] = {}  # island -> its newest heartbeat delivered
        self.next_fault: dict[int, FaultKind] = {}  # idle islands struck: how their next order ends

    def _at(self, t: float, event: Any) -> None:
        heapq.heappush(self._queue, _Pending(t, next(self._seq), event))

    def _fault(self, island: int, n: int) -> Fault | None:
        """What struck `island` idle, else the fault scripted for its `n`-th order."""
        if (kind := self.next_fault.pop(island, None)) is None:
            return next((f for f in self.faults if f.island == island and f.order == n), None)
        if kind == FaultKind.HUNG:
            self.hung[island] = self.t  # its hung time counts from the order it never answers
        return Fault(kind, island, n)  # a machine dead or hung runs no scripted fault

    # -- the protocol ----------------------------------------------------------------
    def now(self) -> float:
        return self.t

    def transfers(self, numel: int) -> Network:
        self.network = Network(self.cfg, self.sim, numel)
        return self.network

    def sleep_until(self, t: float) -> None:
        self.losses.halted += max(0.0, t - self.t)
        self.t = max(self.t, t)

    def head_down(self, seconds: float) -> None:
        """The coordinator restarting for `seconds` after its head failed: the fleet idles
        (counted as halted), and a head node failing meanwhile fails a head already down
        (the same restart)."""
        self.sleep_until(self.t + seconds)
        self.head_failures = [t for t in self.head_failures if t > self.t]

    def stall(self, seconds: float) -> None:
        """The coordinator's thread is busy for `seconds` of this clock (an evaluation or a
        write that slow): the islands go on, and what they send — results, heartbeats — waits
        for the next poll with the time it was sent, as on Ray, where the coordinator's
        listening thread hears the heartbeats meanwhile (`runtime/heartbeats.py`)."""
        self.t += seconds

    def request(
        self, island: int, start_step: int, *, state_folder: str | None = None, restore: SavedState | None = None
    ) -> None:
        if island in self.islands:  # as Ray refuses a second placement group of one name
            raise ValueError(f"island {island} already exists")
        if island in self.unplaceable:
            return
        spec = island_spec(self.cfg, island, start_step, state_folder=state_folder, restore=restore)
        adopted = self.adopted.pop(island, None)
        self.factors[island] = self._node_factor(island)
        if self.t > 0:
            self.losses.placement += self.join_s
        if adopted is not None:
            adopted.reset(spec)
        self.islands[island] = adopted or Island(spec)
        self._at(
            self.t + self.join_s,
            Joined(
                island=island,
                node=f"inprocess:{island}",
                steps_per_s=self._known_speed(island),
                restored=self.islands[island].restored,
                startup=dict(self.islands[island].startup),
                built_sha256=self.islands[island].built_sha256,
                adopted=adopted is not None,
            ),
        )

    def _node_factor(self, island: int) -> float:
        """The slowdown of the node `island` is placed on: its own for an initial island;
        for one placed later, the node a released island gave back (`replacement_speed:
        replaced`) or a full-speed one."""
        if self.sim.slowdown and island < len(self.sim.slowdown):
            return self.sim.slowdown_of(island)
        if self.sim.replacement_speed == ReplacementSpeed.REPLACED and self.freed:
            return self.freed.popleft()
        return 1.0

    def _factor(self, island: int) -> float:
        return self.factors.get(island, 1.0)

    def _measured(self, value: float) -> float:
        """`value` as the island measures it: with `speed_noise`, off by a log-normal factor
        of mean 1."""
        sigma = self.sim.speed_noise
        return value * math.exp(sigma * float(self.noise.standard_normal()) - sigma**2 / 2) if sigma else value

    def _known_speed(self, island: int) -> float:
        """Steps per second of a new island, as its probe measures them."""
        return self._measured(1.0 / (self.step_s * self._factor(island)))

    def reattach(self, island: int) -> str | None:
        return f"inprocess:{island}" if self._alive(island) else None

    def survivors(self) -> list[int]:
        return sorted(i for i in self.islands if self._alive(i))

    def writes_ending(self, islands: list[int]) -> Callable[[float], None]:
        """(`IslandPool.writes_ending`) The islands' own write threads, waited for in turn."""
        live = [self.islands[i] for i in islands if self._alive(i)]

        def wait(timeout_s: float) -> None:
            deadline = time.monotonic() + timeout_s  # the writes' own threads: real time
            for island in live:
                island.written(max(0.0, deadline - time.monotonic()))

        return wait

    def sweep(self, keep: set[int]) -> None:
        for i in [i for i in self.islands if i not in keep]:
            self.release(i)

    def cancel(self, island: int) -> None:
        self.release(island)

    def release(self, island: int) -> None:
        self._drop(lambda p: getattr(p.event, "island", None) == island)
        if self.islands.pop(island, None) is not None and island in self.factors:
            self.freed.append(self.factors[island])
        self.doomed.pop(island, None)
        self.next_fault.pop(island, None)
        self._unhang(island)

    def demand(self, islands: int) -> None:
        self.demanded.append(islands)

    def publish(self, version: int, params: Any) -> np.ndarray:
        """A copy, as `ray.put` makes one (the engine publishes each version once)."""
        return np.concatenate(params) if isinstance(params, list) else np.array(params)

    def share(self, change: Change) -> Change:
        return change

    def dispatch(self, order: WorkOrder, params: Any, changes: tuple[Any, ...] = ()) -> None:
        if changes:
            order = dataclasses.replace(order, changes=changes)
        i = order.island
        self.dispatched.append(order)
        self._unhang(i)  # given work again: the engine gave its hung work up (a restart) and trusts it
        if self.doomed.get(i, math.inf) <= self.t:
            self.dead.add(i)
        if i in self.dead or i not in self.islands:
            self._at(self.t, Failed(ticket=order.ticket, island=i, reason="actor died: island is gone"))
            return
        n = self.orders[i] = self.orders.get(i, 0) + 1
        fault = self._fault(i, n)
        factor, until = self.slow.get(i, (1.0, 0.0))
        step = self.step_s * self._factor(i) * (factor if self.t < until else 1.0)
        delay = self._download_s(i)
        duration = delay + order.steps * step
        if fault is not None and fault.kind == FaultKind.CORRUPT and params is not None:
            params = np.array(params)
            raw = params.view(np.uint8)
            raw[len(raw) // 2] ^= 0xFF
        if fault is not None and fault.kind == FaultKind.LATE:
            duration += fault.seconds
        stops = duration / 2 if fault is not None and fault.kind in (FaultKind.CRASH, FaultKind.HANG) else None
        if fault is not None and fault.kind in (FaultKind.DEAD, FaultKind.HUNG):
            stops = 0.0  # it never starts
        self.started[order.ticket] = self.t + delay
        work = _Work(
            order=order,
            params=params,
            fault=fault,
            step=step,
            start=self.t + delay,
            compute=order.steps * step,  # virtual, so DyLU sees the simulated speeds
            due=self.t + duration,
            seq=next(self._seq),
        )
        gone = self.doomed.get(i, math.inf) - self.t
        doomed = gone < duration and stops is None  # preempted before it finishes
        never = doomed or (
            fault is not None
            and fault.kind in (FaultKind.HANG, FaultKind.HUNG, FaultKind.CRASH, FaultKind.DEAD, FaultKind.RAISE)
        )
        # a work that will never deliver is computed now, as one that fails later is (`_drop`)
        if never and isinstance(self._complete(work), Failed):  # it raised before any fault could strike
            self._at(self.t, work.outcome)
            return
        if doomed:
            self._heartbeats(i, order, delay, duration, gone)
            self._taken(i, order.ticket, self.t + gone)
            return
        self._heartbeats(i, order, delay, duration, stops)
        if fault is not None and fault.kind == FaultKind.HANG:  # it never answers
            self._freeze(i, self.t + duration / 2, order.ticket, order.steps // 2)
            return
        if fault is not None and fault.kind == FaultKind.HUNG:  # hung before it began: its count stands from now
            self._freeze(i, self.t, order.ticket, 0)
            return
        if fault is not None and fault.kind in (FaultKind.CRASH, FaultKind.DEAD):
            self.dead.add(i)
            at = self.t + (duration / 2 if fault.kind == FaultKind.CRASH else 0.0)
            self._at(at, Failed(ticket=order.ticket, island=i, reason="actor died: injected crash"))
            return
        if fault is not None and fault.kind == FaultKind.RAISE:
            self._at(
                self.t + duration / 2, Failed(ticket=order.ticket, island=i, reason="raised: RuntimeError: injected")
            )
            return
        self._at(work.due, work)

    def _complete(self, work: _Work) -> Done | Failed:
        """`work`'s result, computed now (its island's earlier orders still pending first)."""
        if work.outcome is None:
            earlier = [p.event for p in self._queue if isinstance(p.event, _Work) and p.event.island == work.island]
            for w in sorted((w for w in earlier if w.seq < work.seq and w.outcome is None), key=lambda w: w.seq):
                w.outcome = self._compute(w)
            work.outcome = self._compute(work)
        return work.outcome

    def _compute(self, work: _Work) -> Done | Failed:
        """Run `work` on its island: all its steps, or the `budget` a notice left it
        (`Island.stop`, told the steps that fit on this clock)."""
        i, order, fault = work.island, work.order, work.fault
        island = self.islands[i]
        if work.budget is not None:
            island.stop(ticket=order.ticket, after_steps=work.budget)
        try:
            result = island.run(order, work.params)
        except Exception as err:  # an island's exception is its failure, as Ray reports it, never the run's
            return Failed(ticket=order.ticket, island=i, reason=f"raised: {type(err).__name__}: {err}")
        if fault is not None and fault.kind == FaultKind.NAN:
            result = dataclasses.replace(result, payload=_nan_like(result.payload, result.delta()))
        if fault is not None and fault.kind == FaultKind.MISREPORT:
            tokens = {**result.shard_tokens, self.cfg.num_shards + 7: 1000}
            result = dataclasses.replace(result, shard_tokens=tokens, weight=sum(tokens.values()))
        if fault is not None and fault.kind == FaultKind.MALFORMED:
            result = dataclasses.replace(result, payload=fault.payload)
        timed = dataclasses.replace(
            result,
            finished_at=fault.seconds if fault is not None and fault.kind == FaultKind.CLOCK else work.due,
            compute_s=self._measured(work.compute if work.budget is None else work.due - work.start),
            tail_s=result.tail_steps * work.step,
        )
        return Done(ticket=order.ticket, island=i, result=timed)

    def stop(self, island: int, ticket: int, within_s: float | None) -> None:
        """A notice for the pending work `ticket`: it keeps the steps begun by now and those
        that end within `within_s`, short of its pseudo-gradient's send point (a streaming
        order's later steps are its tail: not stopped); none begun and none fit: it fails
        now, as an island raising `Stopped` does."""
        pending = next((p for p in self._queue if isinstance(p.event, _Work) and p.event.ticket == ticket), None)
        if pending is None:  # delivered, lost or never given
            return
        work: _Work = pending.event
        order = work.order
        sends = order.send_after if order.send_after and order.send_after < order.steps else order.steps
        begun = math.ceil(work.steps_at(self.t) - 1e-9)
        fits = 0 if within_s is None else math.floor(work.steps_at(self.t + within_s) + 1e-9)
        keep = min(sends, max(begun, fits))
        if keep >= sends:
            return
        self._queue.remove(pending)
        if island in self.steps_done:  # its heartbeats' count: the steps it will not take
            self.steps_done[island] -= order.steps - keep
        if keep == 0:
            self._silence(island, self.t)
            reason = "raised: Stopped: a preemption notice came before its first step"
            self._at(self.t, Failed(ticket=ticket, island=island, reason=reason))
            return
        work.budget, work.due = keep, work.ends_at(keep)
        self._silence(island, work.due)
        heapq.heapify(self._queue)
        self._at(work.due, work)

    def refresh(self, order: WorkOrder, params: Any, changes: tuple[Any, ...] = ()) -> None:
        """At once (the spare is idle: its download delays nothing it does)."""
        island = self.islands.get(order.island)
        if island is not None and self._alive(order.island):
            island.hold(dataclasses.replace(order, changes=changes) if changes else order, params)

    def _download_s(self, island: int) -> float:
        """How long `island` waits for the parameters it was just sent (the network's
        arrival, from now)."""
        return self.network.arrival(island, self.t) - self.t if self.network is not None else 0.0

    def _heartbeats(self, island: int, order: WorkOrder, delay: float, duration: float, stops: float | None) -> None:
        """With `elastic.hang_after_steps`, the island's step count every `progress_every_s`
        while it works: its steps spread evenly over its compute (a late island's over its
        longer time), none while it downloads, and none after `stops` (a hang or a crash
        halfway: its heartbeats end there)."""
        elastic = self.cfg.elastic
        if elastic.hang_after_steps is None:
            return
        base = self.steps_done.get(island, 0)
        end = duration if stops is None else stops
        compute = max(duration - delay, 1e-12)
        # none read while it downloads (the engine expects progress only once its download
        # is in): a long download over a slow link would queue thousands of still counts
        k = max(1, math.floor(delay / elastic.progress_every_s))
        while (t := k * elastic.progress_every_s) < end:
            done = min(order.steps, int(order.steps * max(0.0, t - delay) / compute))
            self._at(
                self.t + t,
                Progress(island=island, steps=base + done, work_steps=done, ticket=order.ticket, at=self.t + t),
            )
            k += 1
        self.steps_done[island] = base + (
            order.steps if stops is None else int(order.steps * max(0.0, end - delay) / compute)
        )

    def poll(self, timeout: float, wake: float | None = None) -> list[PoolEvent]:
        def until() -> float:  # the next thing to happen: an event, the timeout, a head node's failure
            due = min(self._queue[0].at if self._queue else math.inf, self.t + timeout)
            return min(due, self.head_failures[0]) if self.head_failures else due

        while self.chaos and self.chaos[0].at <= until():
            self._strike(self.chaos.pop(0))
        if self.head_failures and self.head_failures[0] <= until():
            self.t = max(self.t, self.head_failures.pop(0))
            self.losses.head_failures += 1
            raise SliceLost(f"a node of the head failed at {self.t:.1f} s (simulated)")
        if not self._queue or self._queue[0].at > self.t + timeout:
            self.t += timeout
            return []
        first = heapq.heappop(self._queue)
        self.t = max(self.t, first.at)
        events = [first.event]
        while self._queue and self._queue[0].at <= self.t:
            events.append(heapq.heappop(self._queue).event)
        events = [d for d in map(self._deliver, events) if d is not None]
        for e in events:
            if isinstance(e, Progress):
                self.beats[e.island] = e
            if isinstance(e, (Done, Failed)) and e.ticket is not None:
                self.started.pop(e.ticket, None)
        return events

    def _deliver(self, event: Any) -> PoolEvent | None:
        """What a queued entry is when it comes due: a work's result computed now, a hung
        island's heartbeat, a preempted island's work lost (None: it was delivered first)."""
        if isinstance(event, _Work):
            return self._complete(event)
        if isinstance(event, _Frozen):
            return self._beat(event)
        if isinstance(event, _Gone):
            return self._gone(event)
        return event

    def _strike(self, fault: TimedFault) -> None:
        """`fault` hits one island with work due (none working: it passes harmlessly), or
        with `sim.strike_idle` any island alive and not already failing, each as likely
        (`_strike_idle` when it has no work)."""
        working = [p for p in self._queue if isinstance(p.event, _Work)]
        if self.sim.strike_idle:
            healthy = [i for i in sorted(self.islands) if self._healthy(i)]
            if not healthy:
                return
            island = healthy[int(self.rng.integers(len(healthy)))]
            its = [p for p in working if p.event.island == island]
            if not its:
                self._strike_idle(fault, island)
                return
            hit = min(its, key=lambda p: p.event.seq)  # the work it is on
        else:
            if not working:
                return
            hit = working[int(self.rng.integers(len(working)))]
        at, i = max(fault.at, self.t), hit.event.island
        self.losses.strikes[fault.kind] += 1
        if fault.kind == Strike.PREEMPT:
            self._preempt(hit, at + fault.notice)
            return
        self._queue.remove(hit)
        if fault.kind != Strike.SLOW:  # a crashed or hung island's heartbeats end with it
            self._complete(hit.event)  # what it read before, it read
            self._silence(i, at)
            if fault.kind == Strike.HANG and (last := self.beats.get(i)) is not None:
                self._freeze(i, at, hit.event.ticket, last.work_steps or 0, last.steps)
            self.losses.struck[fault.kind] += max(0.0, at - self.started.pop(hit.event.ticket, at))
        if fault.kind == Strike.HANG:
            self.hung[i] = at
        if fault.kind == Strike.CRASH:
            self.dead.add(i)
            self._queue.append(
                _Pending(
                    at, next(self._seq), Failed(ticket=hit.event.ticket, island=i, reason="actor died: injected crash")
                )
            )
        elif fault.kind == Strike.SLOW:
            self.slow[i] = (fault.factor, at + fault.lasts)
            work: _Work = hit.event
            due = at + (hit.at - at) * fault.factor
            work.slowed, work.compute, work.due = (at, fault.factor), work.compute + (due - hit.at), due
            self._repace(work, at)
            self._queue.append(_Pending(due, next(self._seq), work))
        heapq.heapify(self._queue)  # a hang: its result is gone, it never answers

    def _strike_idle(self, fault: TimedFault, island: int) -> None:
        """`fault` hits `island` while it has no work: a crash fails its next order at once
        (as Ray reports a dead actor then; the order's batches are read, as every lost work's
        are here), a hang makes that order never return and its count never move, a
        preemption's notice comes now, a slow-down paces what it starts within `lasts`. Nothing it
        computed is lost (it holds none); the cost is in what comes next."""
        at = max(fault.at, self.t)
        self.losses.strikes[fault.kind] += 1
        if fault.kind in (Strike.CRASH, Strike.HANG):
            self.next_fault[island] = FaultKind.DEAD if fault.kind == Strike.CRASH else FaultKind.HUNG
        elif fault.kind == Strike.PREEMPT:
            self.doomed[island] = at + fault.notice
            self._at(at, Preempting(island=island, notice_s=fault.notice))
        elif fault.kind == Strike.SLOW:  # with `lasts` 0 (`bench fleet`'s) nothing it starts is slowed
            self.slow[island] = (fault.factor, at + fault.lasts)

    def _healthy(self, island: int) -> bool:
        """Alive and not already failing: not dead, going, hung or struck idle."""
        return not (island in self.dead or island in self.doomed or island in self.hung or island in self.next_fault)

    def _alive(self, island: int) -> bool:
        """Placed and not dead (a crash that struck it idle included: found at its next order)."""
        return island in self.islands and island not in self.dead and self.next_fault.get(island) != FaultKind.DEAD

    def _repace(self, work: _Work, at: float) -> None:
        """A slow-down struck `work` at `at`: its heartbeats after it are still read every
        `progress_every_s` (the coordinator reads them on its own clock, not the island's),
        and their counts follow its slower pace. Stretching the reads with the island once
        put a 4x-slowed island's reads 4 s apart; its count then stood still across two of
        them and it was declared hung, though it never stopped stepping."""
        beats = [
            p for p in self._queue if isinstance(p.event, Progress) and p.event.island == work.island and p.at > at
        ]
        if not beats:
            return
        first = min(beats, key=lambda p: p.at)
        base = first.event.steps - (first.event.work_steps or 0)
        self._silence(work.island, at)
        t = first.at
        while t < work.due:
            done = min(work.order.steps, int(work.steps_at(t) + 1e-9))
            beat = Progress(island=work.island, steps=base + done, work_steps=done, ticket=work.ticket, at=t)
            self._queue.append(_Pending(t, next(self._seq), beat))
            t += self.cfg.elastic.progress_every_s

    def _freeze(self, island: int, at: float, ticket: int, work_steps: int, steps: int | None = None) -> None:
        """From `at`, `island` answers its heartbeats with a count stuck at `steps` (default:
        what its hung work had done) until it is released."""
        if self.cfg.elastic.hang_after_steps is None:
            return
        steps = self.steps_done.get(island, 0) if steps is None else steps
        self._at(at, _Frozen(island=island, steps=steps, work_steps=work_steps, ticket=ticket))

    def _beat(self, frozen: _Frozen) -> Progress:
        """A hung island's heartbeat now, and its next one `progress_every_s` later."""
        self._at(self.t + self.cfg.elastic.progress_every_s, frozen)
        return Progress(
            island=frozen.island, steps=frozen.steps, work_steps=frozen.work_steps, ticket=frozen.ticket, at=self.t
        )

    def _silence(self, island: int, after: float, kind: type[Progress | _Frozen] = Progress) -> None:
        """`island`'s heartbeats (of `kind`: a hung island's frozen ones) end at `after`."""
        kept = [p for p in self._queue if not (isinstance(p.event, kind) and p.event.island == island and p.at > after)]
        if len(kept) < len(self._queue):
            self._queue = kept
            heapq.heapify(self._queue)

    def _unhang(self, island: int) -> None:
        """`island`'s hang ends for the account (released, trusted with work again, the run
        over): its undetected time stops, and so do its frozen heartbeats."""
        if island in self.hung:
            self.losses.undetected += self.t - self.hung.pop(island)
        self._silence(island, -math.inf, _Frozen)

    def _preempt(self, hit: _Pending, gone: float) -> None:
        """A preemption notice for the island of `hit`: it is gone at `gone`. Work due before
        then is delivered; work due after fails then, and so does any it is given later."""
        i = hit.event.island
        self.doomed[i] = gone
        self._at(self.t, Preempting(island=i, notice_s=gone - self.t))  # the notice, now
        if hit.at <= gone:
            return
        self._silence(i, gone)
        self._at(gone, _Gone(island=i, ticket=hit.event.ticket))

    def _gone(self, gone: _Gone) -> Failed | None:
        """A preempted island's node is taken now: its work still pending (not stopped in
        time, `stop`) is lost with it."""
        pending = next((p for p in self._queue if isinstance(p.event, _Work) and p.event.ticket == gone.ticket), None)
        if pending is None:
            return None
        self._complete(pending.event)  # what it read before, it read
        self._queue.remove(pending)
        heapq.heapify(self._queue)
        self.dead.add(gone.island)
        self.losses.struck[Strike.PREEMPT] += max(0.0, self.t - self.started.pop(gone.ticket, self.t))
        return Failed(ticket=gone.ticket, island=gone.island, reason="actor died: preempted")

    def _taken(self, island: int, ticket: int, gone: float) -> None:
        """A preempted `island` is gone at `gone` with its work `ticket`: what it computed is lost."""
        self.dead.add(island)
        self.losses.struck[Strike.PREEMPT] += max(0.0, gone - self.started.pop(ticket, gone))
        self._at(gone, Failed(ticket=ticket, island=island, reason="actor died: preempted"))

    def hand_over(self, keep: set[int]) -> dict[int, Any]:
        out = {i: self.islands[i] for i in keep if self._alive(i)}
        for i in list(self.islands):
            self.release(i)
        return out

    def adopt(self, islands: dict[int, Any]) -> None:
        self.adopted.update(islands)

    def close(self) -> None:
        for island in list(self.hung):  # hung to the end of the run
            self._unhang(island)
        self._drop(lambda p: True)
        for each in self.islands.values():  # their inner states' writes end with them, as `RayIslandPool`'s
            each.written()
        self.islands.clear()
        self.adopted.clear()
        self._queue.clear()

    def coordinator_lost(self) -> None:
        """The coordinator process died: the results of its calls die with it (as Ray's
        object references do); the islands live on for the next coordinator."""
        self._drop(lambda p: isinstance(p.event, (_Work, _Gone, Failed)))

    def _drop(self, which: Callable[[_Pending], bool]) -> None:
        """Take the queued entries `which` picks out of the queue. A work among them that
        will now never deliver is computed first: an island whose result is lost (its
        coordinator gone, it released, the run over) still read its batches and moved its
        own state, and the batches a lost work's ledger entry gives back are the ones it read."""
        for p in self._queue:
            if which(p) and isinstance(p.event, _Work) and p.event.island in self.islands:
                self._complete(p.event)
        self._queue = [p for p in self._queue if not which(p)]
        heapq.heapify(self._queue)


def _nan_like(payload: Any, delta: Any) -> Any:
    """A payload of the same codec and layout, all NaN."""
    from archipelago.workers.wire.compress import encode

    if isinstance(payload, Sliced):
        nan = ({k: np.full_like(v, np.nan) if v.dtype.kind == "f" else v for k, v in p.items()} for p in payload.parts)
        return Sliced(parts=tuple(nan))
    return encode(np.full_like(delta, np.nan), "none")
