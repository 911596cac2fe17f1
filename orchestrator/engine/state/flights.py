"""Work in flight as the run's state holds it: what a pacing asks an island to do (`Work`),
each handed-out piece of work and what came back of it (`Flight`), the outer steps a pacing
closes (`Close`), and what the policies may read of the run (`RunState`). Every family
reads these — the pacings decide on them, the ledger of flights keeps them, admission screens
them, checkpoints capture the run — so they sit on the state floor below all of them."""

from __future__ import annotations

from dataclasses import dataclass

from archipelago.workers.wire.messages import RoundResult, WorkKind

from .membership import Membership


@dataclass
class RunState:
    """What the policies may read of a run (the engine owns and updates it)."""

    rounds: int
    inner_steps: int
    members: Membership
    version: int = 0
    base: int = 0  # version the run (re)started from: a CO2 pipeline refills from it
    completed_steps: int = 0  # inner steps of work that came back
    closes: int = 0  # outer steps closed (applied or not)
    stopping: bool = False  # no new work: finish what is in flight
    now: float = 0.0  # the pool's clock when the engine last asked (a pacing may close on time)
    hang_after_steps: float | None = None  # heartbeats' live setting (`elastic.hang_after_steps`)


@dataclass(frozen=True)
class Work:
    """What a pacing wants an island to do; the engine turns it into a `WorkOrder`."""

    island: int
    round: int
    version: int
    steps: int
    kind: WorkKind = WorkKind.TRAIN
    schedule_step: int | None = None
    fragment: int | None = None  # streaming: the fragment this work's exchange sends
    eager: bool = False  # start from `version` moved by the island's own last update (not yet in it)
    send_after: int | None = None  # streaming: Δ is taken after this many steps (τ before the end)


@dataclass
class Flight:
    ticket: int
    work: Work
    deadline: float
    sent_at: float = 0.0  # when it was handed out (the pool's clock)
    result: RoundResult | None = None
    delivered_at: float = 0.0  # when its pseudo-gradient crossed the link (streaming: τ steps before the end)
    received_at: float = 0.0  # when the coordinator had the result in hand (the pool's clock)
    received: int = 0  # bytes its island received for it (a first, full download not counted)
    progress_at: float = 0.0  # heartbeats: when its island's steps last advanced (the pool's clock)
    steps_seen: int | None = None  # ... the step count its island reported then (None: no report yet)
    work_steps: int | None = None  # ... the steps of its current work it reported (None: not known)
    heard_at: float = 0.0  # ... when the newest count it reported was taken
    first_step: tuple[float, int] | None = None  # ... its first report of a step of this work: (when, steps)
    stopping: bool = False  # a preemption notice stopped it: its result may hold fewer steps (`InFlight.stop`)

    @property
    def stepping(self) -> bool:
        """Between the first and the last step of its work, as its heartbeats tell (a report
        read before it began this work speaks of the one before: all its steps, so not)."""
        return self.work_steps is not None and 0 < self.work_steps < self.work.steps

    @property
    def usable_at(self) -> float:
        """From when a step can merge it: crossed its link and in the coordinator's hands."""
        return max(self.delivered_at, self.received_at)


@dataclass
class Close:
    """One outer step to take: the arrived flights, the version their updates must start
    from (`None`: bounded staleness against the current version), and CO2's anchor."""

    round: int
    flights: list[Flight]
    expected: int | None
    anchor: int | None = None
    ages: dict[int, int] | None = (
        None  # island -> its recorded staleness, where the pacing knows it (else the verdict's)
    )
    advances: bool = True  # a round advances the version even if nothing is applied
    fragment: int | None = None  # streaming: the fragment this step updates (None: the whole model)
    factors: dict[int, float] | None = None  # island -> multiplier of its token weight (age-aware merging)
    scale: float = 1.0  # multiplies the merged update (a per-arrival step's share of a round's tokens)
