"""The island pool of tests and benchmarks: islands as plain `Island` objects of this
process on a virtual clock (compute and simulated links advance it, nothing sleeps),
with faults injected by work order (`Fault`) or in time (`chaos.TimedFault`) — so the
engine's behaviour under crashes, late and NaN islands, joins, drains and restarts is
tested in seconds, and a bench runs many simulated islands on two cores."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from orchestrator.config import RunConfig
from orchestrator.engine.pool import Done, Failed, Joined, PoolEvent, Preempting, Progress
from orchestrator.engine.specs import island_spec
from orchestrator.testing.chaos import Strike, TimedFault
from workers.runtime.island import Island
from workers.wire.messages import SavedState, Sliced, WorkOrder
from workers.wire.sync import Change

DISPATCH_LOG = 4096  # orders the in-process pool remembers


class FaultKind(str, Enum):
    CRASH = "crash"  # the island dies during its n-th work order
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

    def __iadd__(self, other: Losses) -> Losses:
        """Another pool's account added (a run of two phases has a pool each)."""
        for k in Strike:
            self.struck[k] += other.struck[k]
            self.strikes[k] += other.strikes[k]
        self.undetected += other.undetected
        self.placement += other.placement
        self.halted += other.halted
        return self


@dataclass(frozen=True)
class _Frozen:
    """A hung island's next heartbeat: alive, answering in its control thread, with a count
    that no longer moves (as a process stuck in its data or a collective answers on Ray)."""

    island: int
    steps: int
    work_steps: int
    ticket: int


@dataclass(order=True)
class _Pending:
    at: float
    seq: int
    event: Any = field(compare=False)


class InProcessPool:
    """Islands as plain `Island` objects; work runs when dispatched, and its result is
    delivered at virtual time `now + steps × step_s × slowdown (+ injected delay)`."""

    def __init__(
        self,
        cfg: RunConfig,
        step_s: float = 1.0,
        faults: list[Fault] | None = None,
        join_s: float = 0.0,
        unplaceable: set[int] | None = None,
        chaos: list[TimedFault] | None = None,
        chaos_seed: int = 0,
    ) -> None:
        """`faults` strike an island's n-th work order; `chaos` strikes in time, each
        fault whichever island (drawn with `chaos_seed`) is working when it comes."""
        self.cfg, self.step_s, self.join_s = cfg, step_s, join_s
        self.chaos = sorted(chaos or [], key=lambda f: f.at)
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

    def _at(self, t: float, event: Any) -> None:
        heapq.heappush(self._queue, _Pending(t, next(self._seq), event))

    def _fault(self, island: int, n: int) -> Fault | None:
        return next((f for f in self.faults if f.island == island and f.order == n), None)

    # -- the protocol ----------------------------------------------------------------
    def now(self) -> float:
        return self.t

    def sleep_until(self, t: float) -> None:
        self.losses.halted += max(0.0, t - self.t)
        self.t = max(self.t, t)

    def request(
        self, island: int, start_step: int, *, state_folder: str | None = None, restore: SavedState | None = None
    ) -> None:
        if island in self.islands:  # as Ray refuses a second placement group of one name
            raise ValueError(f"island {island} already exists")
        if island in self.unplaceable:
            return
        spec = island_spec(self.cfg, island, start_step, state_folder=state_folder, restore=restore)
        adopted = self.adopted.pop(island, None)
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

    def _known_speed(self, island: int) -> float:
        """Steps per second of a new island: known exactly on the virtual clock."""
        return 1.0 / (self.step_s * self.cfg.simulation.slowdown_of(island))

    def reattach(self, island: int) -> str | None:
        return f"inprocess:{island}" if island in self.islands and island not in self.dead else None

    def survivors(self) -> list[int]:
        return sorted(i for i in self.islands if i not in self.dead)

    def sweep(self, keep: set[int]) -> None:
        for i in [i for i in self.islands if i not in keep]:
            self.release(i)

    def cancel(self, island: int) -> None:
        self.release(island)

    def release(self, island: int) -> None:
        self.islands.pop(island, None)
        self.doomed.pop(island, None)
        self._unhang(island)
        self._queue = [p for p in self._queue if getattr(p.event, "island", None) != island]
        heapq.heapify(self._queue)

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
        island = self.islands[i]
        factor, until = self.slow.get(i, (1.0, 0.0))
        step = self.step_s * self.cfg.simulation.slowdown_of(i) * (factor if self.t < until else 1.0)
        duration = order.start_delay_s + order.steps * step
        if fault is not None and fault.kind == FaultKind.CORRUPT and params is not None:
            params = np.array(params)
            raw = params.view(np.uint8)
            raw[len(raw) // 2] ^= 0xFF
        try:
            result = island.run(dataclasses.replace(order, start_delay_s=0.0), params)  # what it read, it read
        except Exception as err:  # an island's exception is its failure, as Ray reports it, never the run's
            self._at(self.t, Failed(ticket=order.ticket, island=i, reason=f"raised: {type(err).__name__}: {err}"))
            return
        if fault is not None and fault.kind == FaultKind.LATE:
            duration += fault.seconds
        stops = duration / 2 if fault is not None and fault.kind in (FaultKind.CRASH, FaultKind.HANG) else None
        self.started[order.ticket] = self.t + order.start_delay_s
        gone = self.doomed.get(i, math.inf) - self.t
        if gone < duration and stops is None:  # preempted before it finishes: what it did is lost
            self._heartbeats(i, order, duration, gone)
            self._taken(i, order.ticket, self.t + gone)
            return
        self._heartbeats(i, order, duration, stops)
        if fault is not None and fault.kind == FaultKind.HANG:
            self._freeze(i, self.t + duration / 2, order.ticket, order.steps // 2)
        if fault is not None and fault.kind == FaultKind.CRASH:
            self.dead.add(i)
            self._at(self.t + duration / 2, Failed(ticket=order.ticket, island=i, reason="actor died: injected crash"))
            return
        if fault is not None and fault.kind == FaultKind.RAISE:
            self._at(
                self.t + duration / 2, Failed(ticket=order.ticket, island=i, reason="raised: RuntimeError: injected")
            )
            return
        if fault is not None and fault.kind == FaultKind.NAN:
            delta = result.delta()
            result = dataclasses.replace(result, payload=_nan_like(result.payload, delta))
        if fault is not None and fault.kind == FaultKind.MISREPORT:
            tokens = {**result.shard_tokens, self.cfg.num_shards + 7: 1000}
            result = dataclasses.replace(result, shard_tokens=tokens, weight=sum(tokens.values()))
        if fault is not None and fault.kind == FaultKind.MALFORMED:
            result = dataclasses.replace(result, payload=fault.payload)
        if fault is not None and fault.kind == FaultKind.HANG:
            return
        compute = order.steps * step  # virtual, so DyLU sees the simulated speeds
        timed = dataclasses.replace(
            result, finished_at=self.t + duration, compute_s=compute, tail_s=result.tail_steps * step
        )
        if fault is not None and fault.kind == FaultKind.CLOCK:
            timed = dataclasses.replace(timed, finished_at=fault.seconds)
        self._at(self.t + duration, Done(ticket=order.ticket, island=i, result=timed))

    def refresh(self, order: WorkOrder, params: Any, changes: tuple[Any, ...] = ()) -> None:
        """At once (the spare is idle: its download delays nothing it does)."""
        island = self.islands.get(order.island)
        if island is not None and order.island not in self.dead:
            island.hold(dataclasses.replace(order, changes=changes) if changes else order, params)

    def _heartbeats(self, island: int, order: WorkOrder, duration: float, stops: float | None) -> None:
        """With `elastic.hang_after_steps`, the island's step count every `progress_every_s`
        while it works: its steps spread evenly over its compute (a late island's over its
        longer time), none while it downloads, and none after `stops` (a hang or a crash
        halfway: its heartbeats end there)."""
        elastic = self.cfg.elastic
        if elastic.hang_after_steps is None:
            return
        base, delay = self.steps_done.get(island, 0), order.start_delay_s
        end = duration if stops is None else stops
        compute = max(duration - delay, 1e-12)
        k = 1
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
        while self.chaos and self.chaos[0].at <= min(self._queue[0].at if self._queue else math.inf, self.t + timeout):
            self._strike(self.chaos.pop(0))
        if not self._queue or self._queue[0].at > self.t + timeout:
            self.t += timeout
            return []
        first = heapq.heappop(self._queue)
        self.t = max(self.t, first.at)
        events = [first.event]
        while self._queue and self._queue[0].at <= self.t:
            events.append(heapq.heappop(self._queue).event)
        events = [self._beat(e) if isinstance(e, _Frozen) else e for e in events]
        for e in events:
            if isinstance(e, Progress):
                self.beats[e.island] = e
            if isinstance(e, (Done, Failed)):
                self.started.pop(e.ticket, None)
        return events

    def _strike(self, fault: TimedFault) -> None:
        """`fault` hits one island with work due (none working: it passes harmlessly)."""
        working = [p for p in self._queue if isinstance(p.event, Done)]
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
            r = hit.event.result
            due = at + (hit.at - at) * fault.factor
            slowed = dataclasses.replace(r, finished_at=due, compute_s=r.compute_s + (due - hit.at))
            for p in self._queue:  # its heartbeats slow down with it
                if isinstance(p.event, Progress) and p.event.island == i and p.at > at:
                    p.at = at + (p.at - at) * fault.factor
                    p.event = dataclasses.replace(p.event, at=p.at)
            self._queue.append(_Pending(due, next(self._seq), Done(ticket=hit.event.ticket, island=i, result=slowed)))
        heapq.heapify(self._queue)  # a hang: its result is gone, it never answers

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
        self._queue.remove(hit)
        self._silence(i, gone)
        self._taken(i, hit.event.ticket, gone)

    def _taken(self, island: int, ticket: int, gone: float) -> None:
        """A preempted `island` is gone at `gone` with its work `ticket`: what it computed is lost."""
        self.dead.add(island)
        self.losses.struck[Strike.PREEMPT] += max(0.0, gone - self.started.pop(ticket, gone))
        self._at(gone, Failed(ticket=ticket, island=island, reason="actor died: preempted"))

    def hand_over(self, keep: set[int]) -> dict[int, Any]:
        out = {i: self.islands[i] for i in keep if i in self.islands and i not in self.dead}
        for i in list(self.islands):
            self.release(i)
        return out

    def adopt(self, islands: dict[int, Any]) -> None:
        self.adopted.update(islands)

    def close(self) -> None:
        for island in list(self.hung):  # hung to the end of the run
            self._unhang(island)
        self.islands.clear()
        self.adopted.clear()
        self._queue.clear()

    def coordinator_lost(self) -> None:
        """The coordinator process died: the results of its calls die with it (as Ray's
        object references do); the islands live on for the next coordinator."""
        self._queue = [p for p in self._queue if not isinstance(p.event, (Done, Failed))]
        heapq.heapify(self._queue)


def _nan_like(payload: Any, delta: Any) -> Any:
    """A payload of the same codec and layout, all NaN."""
    from workers.wire.compress import encode

    if isinstance(payload, Sliced):
        nan = ({k: np.full_like(v, np.nan) if v.dtype.kind == "f" else v for k, v in p.items()} for p in payload.parts)
        return Sliced(parts=tuple(nan))
    return encode(np.full_like(delta, np.nan), "none")
