"""The engine's vocabulary, in one place: island states, admission reasons and decisions,
event kinds, the contribution the outer step consumes, and typed errors.

Every enum is a `str` enum: it compares equal to, and serialises as, its value, so the
JSON the control plane and `summary.json` carry is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class IslandState(str, Enum):
    """`training` gets work; `spare` is placed and built but gets no work until a failed,
    hung or preempted island's place is its (`elastic.spares`); `late` missed a deadline
    (its result, when it comes, is discarded, then it trains again); `draining` gets no
    new work and is released once its round is in; `drained`, `dead` and `quarantined`
    are released for good."""

    STARTING = "starting"
    TRAINING = "training"
    SPARE = "spare"
    LATE = "late"
    DRAINING = "draining"
    DRAINED = "drained"
    DEAD = "dead"
    QUARANTINED = "quarantined"

    @property
    def alive(self) -> bool:
        return self in (IslandState.TRAINING, IslandState.SPARE, IslandState.LATE, IslandState.DRAINING)

    @property
    def gone(self) -> bool:
        return self in (IslandState.DRAINED, IslandState.DEAD, IslandState.QUARANTINED)


class Decision(str, Enum):
    ACCEPT = "accept"
    DOWNWEIGHT = "downweight"  # applied with a reduced weight (too stale, `stale_policy: downweight`)
    REJECT = "reject"
    DROP = "drop"  # accepted but left out on purpose (a bench's ablation: `simulation.drop_prob`)


class Reason(str, Enum):
    """Why an update did not count in full. Only `STALE`/`FUTURE` are the pacing's business;
    the others are faults and count towards quarantine."""

    STALE = "stale"
    FUTURE = "future"
    SHAPE = "shape"
    WEIGHT = "weight"
    NON_FINITE = "non-finite"
    NORM_OUTLIER = "norm outlier"
    SHARDS = "shards"  # what it says it read or trained differs from the work it was given
    MALFORMED = "malformed"  # its payload or its numbers cannot be decoded or trusted
    QUARANTINED = "quarantined"

    @property
    def is_fault(self) -> bool:
        return self not in (Reason.STALE, Reason.FUTURE)


class Event(str, Enum):
    """Kinds of `events.jsonl` lines (and of the control plane's `/v1/events`)."""

    JOIN = "join"
    REATTACH = "reattach"
    REQUESTED = "requested"
    JOIN_FAILED = "join_failed"
    JOIN_CANCELLED = "join_cancelled"
    RESOURCES_REQUESTED = "resources_requested"
    TARGET = "target"
    DRAIN = "drain"
    PREEMPTING = "preempting"
    PARTIAL = "partial"  # a stopped work's prefix arrived: the rest of its batches went back to the ledger
    STRAGGLER = "straggler"  # the budget's end: a work far behind the idle islands was stopped (`elastic.tail_stop`)
    PROMOTED = "promoted"  # a spare took a failed island's place
    RELEASED = "released"
    CRASH = "crash"
    QUARANTINED = "quarantined"
    LATE = "late"
    LOST = "lost"
    REJECTION = "rejection"
    SETTINGS = "settings"
    PAUSED = "paused"
    RESUMED = "resumed"
    STOP_REQUESTED = "stop_requested"
    STOPPED = "stopped"
    CHECKPOINT = "checkpoint"
    RESTART = "restart"


class Phase(str, Enum):
    """Which part of a run is training: its warm start, or the run itself."""

    WARM_START = "warm_start"
    MAIN = "main"


class Merge(str, Enum):
    """Where an island's latest work stands against the outer step (the dashboard's
    `result` column): `training` it; `waiting` for its step (in the quorum's grace window,
    or for the rest of a barrier round); `merged` into the step of its version; `late`,
    merged into a later step (discounted by its age)."""

    TRAINING = "training"
    WAITING = "waiting"
    MERGED = "merged"
    LATE = "late"


class RunPhase(str, Enum):
    STARTING = "starting"
    TRAINING = "training"
    PAUSED = "paused"
    FINISHED = "finished"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(frozen=True, kw_only=True)
class Contribution:
    """One island's update for the outer step: Δ = θ_start − θ_end (a gradient in ddp), as
    one fp32 vector or, for a sliced coordinator, as its S encoded slices."""

    island: int
    version: int
    delta: Any
    weight: float
    steps: int = 1  # inner steps behind it (weights are compared per step)
    fragment: int | None = None  # streaming: the fragment it updates (None: the whole vector)


class RunFailed(RuntimeError):
    """The run cannot continue (for example every island has died)."""


class SliceLost(RuntimeError):
    """A coordinator slice died and took its part of the global state with it; the
    runtime restarts the coordinator from its last checkpoint."""


class LedgerError(RuntimeError):
    """The data ledger's exactly-once invariant would break (a bug, never a user error)."""


@dataclass(frozen=True)
class Verdict:
    """Admission's judgement of one update (`step/admission.py`), which the stats count."""

    decision: Decision
    reason: Reason | None = None
    detail: str = ""
    scale: float = 1.0
    staleness: int = 0

    @property
    def admitted(self) -> bool:
        return self.decision in (Decision.ACCEPT, Decision.DOWNWEIGHT)

    @property
    def why(self) -> str:
        return f"{self.reason.value}: {self.detail}" if self.reason else ""
