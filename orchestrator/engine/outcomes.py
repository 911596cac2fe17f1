"""What the engine's collaborators decide and the engine carries out, in one place
(`RoundEngine._apply`): the fleet's scaling decisions, a verdict heading for the
quarantine count, an island lost, an island to release, a stop-the-world halt. The
collaborators return these instead of calling back into the engine, so a chain of
consequences (a verdict quarantines an island, its release gives up its work, a restart
policy halts the fleet) is applied in order by one loop, and `step()` reports it."""

from __future__ import annotations

from dataclasses import dataclass

from .types import IslandState, RunPhase, Verdict


@dataclass(frozen=True, kw_only=True)
class Place:
    """Request a new island at this index."""

    island: int


@dataclass(frozen=True, kw_only=True)
class Promote:
    """A hot spare takes a place in the target: it gets work from now on."""

    island: int


@dataclass(frozen=True, kw_only=True)
class StartDrain:
    """Let the island finish its round, then release it."""

    island: int


@dataclass(frozen=True, kw_only=True)
class StopWork:
    """A preemption notice (`notice_s` before the island is taken, None: unknown): its work
    out takes no step that would not end in time and sends what it has trained
    (`elastic.partial_on_notice`); or a straggler at the budget's end, stopped after its
    step in progress so that idle islands train its rest (`elastic.tail_stop`)."""

    island: int
    notice_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class Release:
    """Release the island for good: its work still out is lost (retrained by the next
    owner of its shards), its results already in still count."""

    island: int
    state: IslandState
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class Judged:
    """A verdict on an island's result, for the fleet's count of bad updates in a row."""

    island: int
    verdict: Verdict
    version: int | None = None  # the version the result was trained on (None: refused unread)


@dataclass(frozen=True, kw_only=True)
class Lost:
    """An island died, raised, hung or is quarantined: the failure policy decides."""

    island: int
    reason: str
    state: IslandState = IslandState.DEAD


@dataclass(frozen=True, kw_only=True)
class Halt:
    """Stop the world (a bench's checkpoint-restart baseline, `simulation.restart_s`): every island's work not yet stepped
    is given up, and nothing trains for `seconds`."""

    seconds: float
    reason: str


FleetDecision = Place | Promote | StartDrain | Release
Outcome = Place | Promote | StartDrain | StopWork | Release | Judged | Lost | Halt


@dataclass(frozen=True, kw_only=True)
class Transition:
    """What one `RoundEngine.step()` did: the phase before and after, and the outcomes it
    carried out in order. True while the run goes on (`while engine.step(): ...`)."""

    before: RunPhase
    after: RunPhase
    outcomes: tuple[Outcome, ...]
    running: bool

    def __bool__(self) -> bool:
        return self.running
