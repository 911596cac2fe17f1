"""Pacing: when islands get work, from which version, and when updates are turned into an
outer step. The engine asks; a pacing only keeps its own bookkeeping over `RunState`.

- `Barrier` (diloco, ddp): every island trains from the same version; the step closes
  when every island's work has resolved (arrived, lost or late).
- `PerArrival` (async, Delayed Nesterov / naive): an island gets new work from the newest
  version as soon as it delivers; every arrival is its own outer step. H per island from
  its measured speed (DyLU); the token budget equals the synchronous run's
  (`TokenBudget`; both in `engine/pacing/arrivals.py`).
- `Quorum` (async, `mode.rule: quorum`; `engine/pacing/quorum.py`): a step fires once a quorum has
  arrived and an adaptive grace window has passed, merging what arrived token-weighted
  and discounted by age; a straggler's result merges into a later step.
- `OneRoundLag` (overlap, CO2): an island that delivers round t starts round t+1 at once,
  from the version round t−1 produced, so the exchange of round t hides behind round t+1;
  round t closes (in order) once every island given it has resolved.

- `FragmentSchedule` (streaming): rounds are P segments of H/P steps, each sending one
  fragment τ steps before it ends (its exchange hides behind those τ steps), paced by a
  `Barrier`: the next segment merges the fragment's new global values as it starts.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from archipelago.workers.wire.messages import WorkKind

from ..state.flights import Close, Flight, RunState, Work


def _islands(flights: list[Flight]) -> list[int]:
    return [f.work.island for f in flights]


def _crossing(flights: list[Flight], now: float) -> float | None:
    """When the last of `flights` is usable, if that is still to come: a step waits for its
    results to cross their (simulated) links without the engine sleeping, so islands not
    waiting on that step keep being served meanwhile (under a one-round lag, the very
    islands whose upload is crossing)."""
    due = max((f.usable_at for f in flights), default=now)
    return due if due > now else None


def _by_island(flight: Flight) -> int:
    """Updates are averaged in island order, whatever order they arrived in, so a run's
    floating-point sums (and so its numbers) do not depend on timing."""
    return flight.work.island


class Pacing(Protocol):
    lag: int  # how many versions behind the newest work may start (a one-round lag: 1)
    # every island waits for a step this pacing closes (none trains meanwhile), so the step
    # may take the cores the islands on its host reserve (`Outputs.step_threads`)
    islands_wait: bool

    def plan(self, run: RunState, idle: list[int]) -> list[Work]: ...
    def cancel(self, work: Work) -> None: ...
    def arrived(self, flight: Flight) -> None: ...
    def lost(self, flight: Flight) -> None: ...
    def shortened(self, flight: Flight, steps: int) -> None:
        """A work a notice stopped came back with only its first `steps` steps (before
        `arrived`): where the pacing hands out a budget of steps, the rest go back to it."""

    def next_close(self, run: RunState, in_flight: list[Flight]) -> Close | None: ...
    def wake(self, run: RunState, in_flight: list[Flight]) -> float | None:
        """When (the pool's clock) a step may close with nothing arriving, or None."""

    def closed(self, run: RunState, close: Close) -> list[int]:
        """The rounds this close completes, in order, each to be recorded once (a close
        can complete several, or none)."""

    def between_rounds(self, in_flight: list[Flight]) -> bool: ...
    def done(self, run: RunState) -> bool: ...
    def spent(self, run: RunState) -> bool:
        """Every step of the run's budget is handed out: an idle island gets no more work,
        and the steps a stopped work gives back (`shortened`) would go to the idle ones
        (`elastic.tail_stop`). Never, for a pacing without a budget of steps."""

    def resume(self, run: RunState, recorded: int) -> None:
        """Continue from a checkpoint's `run` (versions, completed steps), whose records
        went up to round `recorded` (a round is never recorded twice)."""

    def restart(self, run: RunState) -> None:
        """Every island's work was given up (a stop-the-world restart): start the step
        over from the current version."""


class Barrier:
    """`steps_per_record` outer steps make one recorded round (1 for diloco; H for ddp,
    whose every batch is one step of the inner optimizer on the mean gradient)."""

    lag = 0
    islands_wait = True  # a step closes once every island handed work has answered

    def __init__(self, kind: WorkKind, steps_per_record: int) -> None:
        self.kind, self.per_record = kind, steps_per_record
        self.open: list[Flight] = []
        self.out = 0  # work handed out for the open step

    def _steps(self, run: RunState) -> int:
        return 1 if self.kind == WorkKind.GRADIENT else run.inner_steps

    def plan(self, run: RunState, idle: list[int]) -> list[Work]:
        if self.out or run.stopping or self.done(run):
            return []
        work = [Work(i, run.closes + 1, run.version, self._steps(run), self.kind) for i in idle]
        self.out = len(work)
        return work

    def cancel(self, work: Work) -> None:
        self.out -= 1  # more islands than shards: this one idles this step

    def arrived(self, flight: Flight) -> None:
        self.open.append(flight)

    def lost(self, flight: Flight) -> None:
        pass

    def shortened(self, flight: Flight, steps: int) -> None:
        pass  # a round counts works, not steps: a shorter one still closes it

    def next_close(self, run: RunState, in_flight: list[Flight]) -> Close | None:
        if not self.out or in_flight or _crossing(self.open, run.now) is not None:
            return None
        flights, self.open, self.out = sorted(self.open, key=_by_island), [], 0
        # the version counts outer steps taken: a step whose every update was lost or
        # rejected does not advance it (the round still counts), so lost steps show
        return Close(
            run.closes + 1, flights, expected=run.version, ages=dict.fromkeys(_islands(flights), 0), advances=False
        )

    def wake(self, run: RunState, in_flight: list[Flight]) -> float | None:
        return None if not self.out or in_flight else _crossing(self.open, run.now)

    def closed(self, run: RunState, close: Close) -> list[int]:
        return [run.closes // self.per_record] if run.closes % self.per_record == 0 else []

    def between_rounds(self, in_flight: list[Flight]) -> bool:
        return not self.out

    def done(self, run: RunState) -> bool:
        return run.closes >= run.rounds * self.per_record

    def spent(self, run: RunState) -> bool:
        return False  # a round's work is its islands': none hands steps to another

    def resume(self, run: RunState, recorded: int) -> None:
        pass

    def restart(self, run: RunState) -> None:
        self.open, self.out = [], 0


def start_version(round_t: int, base: int = 0) -> int:
    """The version round `round_t` (1-based) starts from under a one-round lag, after one
    synchronous round: round base+1 starts from `base` (0, or the version a restart
    resumed from), round base+2 from base+1 (it waits for that first step), and from then
    on round t from t−2. Lagging from the first round would apply the first two
    pseudo-gradients both against `base`, where they are largest."""
    return base if round_t <= base + 1 else max(base + 1, round_t - 2)


class OneRoundLag:
    lag = 1
    islands_wait = False  # the next round trains during the step

    def __init__(self, eager: bool = False) -> None:
        """`eager`: mark work whose start version lacks its island's own last update."""
        self.eager = eager
        self.next_round: dict[int, int] = {}
        self.arrivals: dict[int, list[Flight]] = {}
        self.dispatched: dict[int, int] = {}  # round -> flights handed out for it
        self.stalled: set[int] = set()  # islands whose last work found no free shard

    def plan(self, run: RunState, idle: list[int]) -> list[Work]:
        if run.stopping:
            return []
        out = []
        head = run.version + 1
        head_free = not self.dispatched.get(head) and not self.arrivals.get(head)
        for i in idle:
            t = self.next_round.get(i)
            delivered = t is not None and t > run.version  # it delivered round t − 1 and goes on
            if t is None or t <= run.version:  # new, re-admitted, or its round closed while it was
                # stalled: the head round if nobody trains it and it starts from the newest
                # version, else the one after (which does)
                t = head if head_free and start_version(head, run.base) == run.version else head + 1
                self.next_round[i] = t
            if t > run.rounds or run.version < start_version(t, run.base):
                continue  # past the budget, or waiting for the version its round starts from
            self.stalled.discard(i)  # `cancel` marks it again if no shard is free
            s = start_version(t, run.base)
            out.append(Work(i, t, s, run.inner_steps, eager=self.eager and delivered and s < t - 1))
            self.dispatched[t] = self.dispatched.get(t, 0) + 1
        return out

    def cancel(self, work: Work) -> None:
        """No free data shard for it now (more islands than shards, or its shards are still
        reserved by results the next close commits). `next_close` waits for islands about to
        start a round; waiting for one that cannot start would hold that round, and the
        commit that frees the shards, open forever. So it is marked stalled, and the round
        may close without it; it joins a later round once a shard is free."""
        self.dispatched[work.round] -= 1
        self.stalled.add(work.island)

    def arrived(self, flight: Flight) -> None:
        t = flight.work.round
        self.arrivals.setdefault(t, []).append(flight)
        self.next_round[flight.work.island] = t + 1

    def lost(self, flight: Flight) -> None:
        self.dispatched[flight.work.round] = self.dispatched.get(flight.work.round, 1) - 1
        self.next_round.pop(flight.work.island, None)

    def shortened(self, flight: Flight, steps: int) -> None:
        pass  # a round counts works, not steps: a shorter one still closes it

    def next_close(self, run: RunState, in_flight: list[Flight]) -> Close | None:
        """Round t = version + 1 closes once none of its work is out. A round whose every
        piece of work was lost closes empty (no step) once a later round has work, so the
        pipeline never waits on a round nobody trains."""
        t = run.version + 1
        if t > run.rounds or any(f.work.round == t for f in in_flight):
            return None
        busy = {f.work.island for f in in_flight}
        waiting = [i for i in run.members.schedulable() if i not in busy and i not in self.stalled]
        if not run.stopping and any(self.next_round.get(i) == t for i in waiting):
            return None  # an island that delivered round t−1 is about to start round t
        if not self.arrivals.get(t):
            later = any(r > t for r in self.arrivals) or any(f.work.round > t for f in in_flight)
            if not later:
                return None
        if _crossing(self.arrivals.get(t, []), run.now) is not None:
            return None  # its islands meanwhile start round t + 1 from the version before
        flights = sorted(self.arrivals.pop(t, []), key=_by_island)
        self.dispatched.pop(t, None)
        s = start_version(t, run.base)
        return Close(t, flights, expected=s, anchor=s, ages=dict.fromkeys(_islands(flights), (t - 1) - s))

    def wake(self, run: RunState, in_flight: list[Flight]) -> float | None:
        t = run.version + 1
        if any(f.work.round == t for f in in_flight):
            return None
        return _crossing(self.arrivals.get(t, []), run.now)

    def closed(self, run: RunState, close: Close) -> list[int]:
        return [close.round]

    def between_rounds(self, in_flight: list[Flight]) -> bool:
        return True

    def done(self, run: RunState) -> bool:
        return run.version >= run.rounds

    def spent(self, run: RunState) -> bool:
        return False

    def resume(self, run: RunState, recorded: int) -> None:
        pass  # the pipeline refills from `run.base`

    def restart(self, run: RunState) -> None:
        """The pipeline refills from the current version, as after a resume."""
        self.next_round.clear()
        self.arrivals.clear()
        self.dispatched.clear()
        self.stalled.clear()
        run.base = run.version


class FragmentSchedule:
    """Streaming DiLoCo's staggered schedule over another pacing. Segment t (1-based over
    the run, H/P inner steps) sends fragment (t − 1) mod P, taken `tau` steps before the
    segment ends, and its outer step closes the segment, so fragment p is synchronised
    every H steps, H/P after fragment p − 1, and merged τ steps after it left; a round (H
    steps, what records and the budget count) is P segments. `inner` paces the segments
    through a view of the run in segments, so its rules (barrier, membership) hold
    unchanged."""

    def __init__(self, inner: Pacing, fragments: int, tau: int) -> None:
        self.inner, self.p, self.tau = inner, fragments, tau
        self.lag = inner.lag
        self.islands_wait = inner.islands_wait and tau == 0  # with τ, islands train on while their fragment travels

    def _view(self, run: RunState) -> RunState:
        return dataclasses.replace(run, rounds=run.rounds * self.p, inner_steps=max(1, run.inner_steps // self.p))

    def _fragment(self, segment: int) -> int:
        return (segment - 1) % self.p

    def plan(self, run: RunState, idle: list[int]) -> list[Work]:
        return [
            dataclasses.replace(w, fragment=self._fragment(w.round), send_after=max(0, w.steps - self.tau))
            for w in self.inner.plan(self._view(run), idle)
        ]

    def cancel(self, work: Work) -> None:
        self.inner.cancel(work)

    def arrived(self, flight: Flight) -> None:
        self.inner.arrived(flight)

    def lost(self, flight: Flight) -> None:
        self.inner.lost(flight)

    def shortened(self, flight: Flight, steps: int) -> None:
        self.inner.shortened(flight, steps)

    def next_close(self, run: RunState, in_flight: list[Flight]) -> Close | None:
        close = self.inner.next_close(self._view(run), in_flight)
        if close is not None:
            close.fragment = self._fragment(close.round)
        return close

    def wake(self, run: RunState, in_flight: list[Flight]) -> float | None:
        return self.inner.wake(self._view(run), in_flight)

    def closed(self, run: RunState, close: Close) -> list[int]:
        return [segment // self.p for segment in self.inner.closed(self._view(run), close) if segment % self.p == 0]

    def between_rounds(self, in_flight: list[Flight]) -> bool:
        return self.inner.between_rounds(in_flight)

    def done(self, run: RunState) -> bool:
        return self.inner.done(self._view(run))

    def spent(self, run: RunState) -> bool:
        return self.inner.spent(self._view(run))

    def resume(self, run: RunState, recorded: int) -> None:
        self.inner.resume(self._view(run), recorded)

    def restart(self, run: RunState) -> None:
        self.inner.restart(self._view(run))
