"""Quorum pacing (`mode: async`, `mode.rule: quorum`): asynchronous training that
never waits for the slowest island and never steps on one lonely update.

Every island trains from the newest version for H_i inner steps (H_i from its measured
speed when `mode.dylu`, so the islands of one step finish at about the same
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

Per fragment (`mode: streaming`, `mode.pacing: quorum`), as Decoupled DiLoCo
synchronises: each work is a segment of H_i / P steps that sends one fragment `tau` steps
before it ends: the fleet's current fragment, which moves on after each step from the one
most of its results carried (islands starting together send the same fragment, and a late
island falls back in step at its next start). The quorum counts
results of any fragment; when the step fires, each fragment among the results gets its
own outer step (its own optimizer state) on its own results, token-weighted, a result's
age counted in steps of *its* fragment. Late fragments merge into that fragment's next
step; nobody waits for a fragment to come round again.
"""

from __future__ import annotations

import bisect
import dataclasses
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...algorithms.dylu import SpeedTracker
from ..commands import SettingsUpdate
from ..state.flights import Close, Flight, RunState, Work
from .arrivals import TokenBudget

RULE_SETTINGS = ("quorum", "grace_cap", "grace_k", "age_power")  # the rule's live settings
OFFSETS = 32  # arrival offsets remembered for the window (recent fleet behaviour only)
MIN_OFFSETS = 4  # fewer than this: the window is the cap (no spread to read yet)


@dataclass
class QuorumRule:
    """The live-tunable settings (`mode.*`); None quorum: half the live islands."""

    quorum: int | None
    grace_cap: float  # the window is at most this × the median duration of recent work
    grace_k: float  # the window is median + k·MAD of recent arrival offsets
    age_power: float  # a result `a` versions old merges with weight tokens × (1 + a)^−α

    def apply(self, update: SettingsUpdate) -> None:
        """Take the rule's settings an operator changed (from the next step on)."""
        self.restore({name: getattr(update, name) for name in RULE_SETTINGS})

    def restore(self, settings: Mapping[str, Any]) -> None:
        """Take the settings given (None: unchanged). A checkpoint's are the rule's own values
        — a barrier's infinite grace among them — not an operator's input, so they are not
        held to the API's bounds: read through `SettingsUpdate`, a `mode.dylu` run's
        restarted coordinator was refused its own grace (inf > 100) and could not start."""
        for name in RULE_SETTINGS:
            if (value := settings.get(name)) is not None:
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


def _close(
    number: int,
    flights: list[Flight],
    factors: dict[int, float],
    fragment: int | None = None,
    ages: dict[int, int] | None = None,
) -> Close:
    """A step on `flights`' token- and age-weighted mean. The weights are normalised, so
    a step made only of late results would move as far as a fresh one: it is scaled by
    the youngest result's factor (1 as soon as one result is fresh). Late fragments often
    step alone (the others have moved on to the next fragment)."""
    scale = max(factors.values())
    return Close(number, flights, None, advances=False, fragment=fragment, factors=factors, scale=scale, ages=ages)


class Quorum(TokenBudget):
    def __init__(
        self,
        rule: QuorumRule,
        dylu: bool,
        speeds: SpeedTracker,
        islands: int,
        schedule_offset: int = 0,
        fragments: int = 0,
        tau: int = 0,
    ) -> None:
        """`islands`: the configured count (the token budget is the synchronous run's).
        `fragments` > 0: streaming's P fragments, each work a segment of H_i / P steps that
        sends one fragment `tau` steps before it ends (see the module's last section)."""
        super().__init__(dylu, speeds, islands, schedule_offset)
        self.rule = rule
        self.reached_at: float | None = None  # when the open step's quorum was reached
        self.last_reached: float | None = None  # the previous step's, for late arrivals' offsets
        self.offsets: deque[float] = deque(maxlen=OFFSETS)
        self.durations: deque[float] = deque(maxlen=OFFSETS)
        self.p, self.tau = fragments, tau
        self.cursor = 0  # the fragment every segment handed out now sends
        self.stepped: list[list[int]] = [[] for _ in range(fragments)]  # versions each fragment stepped to
        self.pending: list[Close] = []  # a group's fragment steps still to hand the engine

    def wanted(self, run: RunState, island: int) -> int:
        h = super().wanted(run, island)
        return max(1, h // self.p) if self.p else h

    def plan(self, run: RunState, idle: list[int]) -> list[Work]:
        if run.stopping:
            return []
        # merged at the next step (or a pending fragment step of it), then restarted
        waiting = {f.work.island for c in self.pending for f in c.flights}
        return [self._segment(w, run.inner_steps // self.p) if self.p else w for w in self.hand(run, idle, waiting)]

    def _segment(self, work: Work, full: int) -> Work:
        """A segment sends the fleet's current fragment (`cursor`), so islands that start
        together send the same one, and a late island falls back in step at its next start.
        Its pseudo-gradient leaves τ·steps/`full` steps before the end: τ is time to hide
        (τ steps of a full segment), and a slower island's shorter segment covers that time
        in fewer steps (a fixed τ of 5 would send an island of 6-step segments its Δ after
        one step, and the merge would replace the five it trained after)."""
        tail = round(self.tau * work.steps / max(1, full))
        return dataclasses.replace(work, fragment=self.cursor, send_after=max(0, work.steps - tail))

    def arrived(self, flight: Flight) -> None:
        self.durations.append(max(0.0, flight.usable_at - flight.sent_at))
        if self.reached_at is not None:
            self.offsets.append(flight.usable_at - self.reached_at)
        elif self.last_reached is not None and flight.sent_at < self.last_reached:
            self.offsets.append(flight.usable_at - self.last_reached)  # it missed the last step
        super().arrived(flight)

    def _ready_at(self, run: RunState, in_flight: list[Flight]) -> float | None:
        """When the open step may fire (None: no quorum yet, or a stop waiting for all)."""
        if not self.queue:
            return None
        if not in_flight:  # nobody else can deliver: waiting past the last usable would only idle the arrived
            return max(run.now, *(f.usable_at for f in self.queue))
        needed = self.rule.needed(len(run.members.schedulable()))
        if len(self.queue) < needed or run.stopping:
            return None
        if self.reached_at is None:
            # usable, not delivered: a streaming Δ crosses its link τ steps before its island
            # finishes, but the coordinator has it only then; a window counted from the
            # crossing had closed before the others' results, delivered alike, were in hand
            self.reached_at = sorted(f.usable_at for f in self.queue)[needed - 1]
        round_s = statistics.median(self.durations) if self.durations else 0.0
        return self.reached_at + grace_window(list(self.offsets), round_s, self.rule)

    def wake(self, run: RunState, in_flight: list[Flight]) -> float | None:
        return self._ready_at(run, in_flight)

    def next_close(self, run: RunState, in_flight: list[Flight]) -> Close | None:
        if self.pending:
            return self.pending.pop(0)
        at = self._ready_at(run, in_flight)
        if at is None or run.now < at:
            return None
        # what the coordinator has in hand now: a result still crossing its (simulated) link
        # waits for the next step, as it would on a cluster, where it is not received yet
        flights = sorted((f for f in self.queue if f.usable_at <= run.now), key=lambda f: f.work.island)
        self.queue = [f for f in self.queue if f.usable_at > run.now]
        self.last_reached, self.reached_at = self.reached_at, None
        if not self.p:
            factors = {f.work.island: age_factor(run.version - f.work.version, self.rule.age_power) for f in flights}
            return _close(run.closes + 1, flights, factors)
        groups: dict[int, list[Flight]] = {}
        for f in flights:
            assert f.work.fragment is not None
            groups.setdefault(f.work.fragment, []).append(f)
        # the fleet moves on from the fragment most of these results carried
        self.cursor = (max(groups, key=lambda p: len(groups[p])) + 1) % self.p
        for n, (fragment, group) in enumerate(sorted(groups.items())):
            # a result's age: the steps *its fragment* took since its work started
            done = self.stepped[fragment]  # increasing
            ages = {f.work.island: len(done) - bisect.bisect_right(done, f.work.version) for f in group}
            factors = {i: age_factor(a, self.rule.age_power) for i, a in ages.items()}
            self.pending.append(_close(run.closes + 1 + n, group, factors, fragment, ages))
        return self.pending.pop(0)

    def closed(self, run: RunState, close: Close) -> list[int]:
        if close.fragment is not None:
            self.stepped[close.fragment].append(run.version)
        return super().closed(run, close)

    def done(self, run: RunState) -> bool:
        return super().done(run) and not self.pending

    def restart(self, run: RunState) -> None:
        super().restart(run)
        self.reached_at = None
        self.pending = []  # their flights were lost with the restart
