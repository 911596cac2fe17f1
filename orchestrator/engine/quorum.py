"""Quorum pacing (`mode: async`, `asynchronous.rule: quorum`): asynchronous training that
never waits for the slowest island and never steps on one lonely update.

Every island trains from the newest version for H_i inner steps (H_i from its measured
speed when `asynchronous.dylu`, so the islands of one step finish at about the same
time). An outer step fires once `quorum` results are in and a grace window after that
has passed; it merges everything that arrived, token-weighted and discounted by age.
The islands that arrived restart at once from the new version; an island still training
is never waited for beyond the window, and its result merges into the next step, older
by the versions taken meanwhile (`age_factor`).

The window adapts to how the fleet arrives: it is median + k·MAD of recent *offsets*
(how long after the quorum was reached the other islands' results came), capped at
`grace_cap` × the median duration of recent work. Islands about to arrive are merged;
a straggler or a hung island adds no offset it never delivers, so it cannot stretch the
window, and the cap bounds what any step waits. With `quorum` = every island and an
unbounded cap this is a barrier round with Dynamic Local Updates (`sync_dylu`).

The rule's settings are read at every step from a mutable `QuorumRule`, so a change made
through the control plane takes effect at the next step.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from orchestrator.algorithms.dylu import SpeedTracker
from orchestrator.engine.arrivals import TokenBudget
from orchestrator.engine.commands import SettingsUpdate
from orchestrator.engine.pacing import Close, Flight, RunState, Work

OFFSETS = 32  # arrival offsets remembered for the window (recent fleet behaviour only)
MIN_OFFSETS = 4  # fewer than this: the window is the cap (no spread to read yet)


@dataclass
class QuorumRule:
    """The live-tunable settings (`asynchronous.*`); None quorum: half the live islands."""

    quorum: int | None
    grace_cap: float  # the window is at most this × the median duration of recent work
    grace_k: float  # the window is median + k·MAD of recent arrival offsets
    age_power: float  # a result `a` versions old merges with weight tokens × (1 + a)^−α

    def apply(self, update: SettingsUpdate) -> None:
        """Take the rule's settings an operator changed (from the next step on)."""
        for name in ("quorum", "grace_cap", "grace_k", "age_power"):
            if (value := getattr(update, name)) is not None:
                setattr(self, name, value)

    def needed(self, live: int) -> int:
        """Results that make a quorum among `live` islands (never more than there are)."""
        q = self.quorum if self.quorum is not None else (live + 1) // 2
        return max(1, min(q, live))


def age_factor(age: int, power: float) -> float:
    """(1 + a)^−α: a fresh result (a = 0) keeps its token weight."""
    return float((1.0 + max(0, age)) ** -power)


def grace_window(offsets: list[float], round_s: float, rule: QuorumRule) -> float:
    """How long after the quorum a step waits: median + k·MAD of the offsets, capped."""
    cap = rule.grace_cap * round_s
    if len(offsets) < MIN_OFFSETS:
        return cap
    med = statistics.median(offsets)
    mad = statistics.median(abs(x - med) for x in offsets)
    return min(cap, med + rule.grace_k * mad)


class Quorum(TokenBudget):
    def __init__(
        self, rule: QuorumRule, dylu: bool, speeds: SpeedTracker, islands: int, schedule_offset: int = 0
    ) -> None:
        """`islands`: the configured count (the token budget is the synchronous run's)."""
        super().__init__(dylu, speeds, islands, schedule_offset)
        self.rule = rule
        self.reached_at: float | None = None  # when the open step's quorum was reached
        self.last_reached: float | None = None  # the previous step's, for late arrivals' offsets
        self.offsets: deque[float] = deque(maxlen=OFFSETS)
        self.durations: deque[float] = deque(maxlen=OFFSETS)

    def plan(self, run: RunState, idle: list[int]) -> list[Work]:
        if run.stopping:
            return []
        waiting = {f.work.island for f in self.queue}  # merged at the next step, then restarted
        out = []
        for i in (i for i in idle if i not in waiting):
            work = self.work(run, i)
            if work is None:
                break
            out.append(work)
        return out

    def arrived(self, flight: Flight) -> None:
        self.durations.append(max(0.0, flight.delivered_at - flight.sent_at))
        if self.reached_at is not None:
            self.offsets.append(flight.delivered_at - self.reached_at)
        elif self.last_reached is not None and flight.sent_at < self.last_reached:
            self.offsets.append(flight.delivered_at - self.last_reached)  # it missed the last step
        super().arrived(flight)

    def _ready_at(self, run: RunState, in_flight: list[Flight]) -> float | None:
        """When the open step may fire (None: no quorum yet, or a stop waiting for all)."""
        if not self.queue:
            return None
        if not in_flight:  # nobody else can deliver: waiting would only idle the arrived
            return run.now
        needed = self.rule.needed(len(run.members.schedulable()))
        if len(self.queue) < needed or run.stopping:
            return None
        if self.reached_at is None:
            self.reached_at = sorted(f.delivered_at for f in self.queue)[needed - 1]
        round_s = statistics.median(self.durations) if self.durations else 0.0
        return self.reached_at + grace_window(list(self.offsets), round_s, self.rule)

    def wake(self, run: RunState, in_flight: list[Flight]) -> float | None:
        return self._ready_at(run, in_flight)

    def next_close(self, run: RunState, in_flight: list[Flight]) -> Close | None:
        at = self._ready_at(run, in_flight)
        if at is None or run.now < at:
            return None
        flights = sorted(self.queue, key=lambda f: f.work.island)
        factors = {f.work.island: age_factor(run.version - f.work.version, self.rule.age_power) for f in flights}
        self.queue, self.last_reached, self.reached_at = [], self.reached_at, None
        return Close(run.closes + 1, flights, expected=None, advances=False, factors=factors)

    def restart(self, run: RunState) -> None:
        super().restart(run)
        self.reached_at = None
