"""Who is in the run: per-island bookkeeping (state, contributions, tokens, bytes,
staleness), the target island count and joins still being placed. Pure logic: the fleet
(`engine/fleet/fleet.py`) changes it, the island pool does the placing.

States are `IslandState` (see `engine/types.py`): `training` gets work, `late` gets work
again once its overdue result arrives (and is discarded), `draining` finishes or abandons
its work and is released, `drained`, `dead` and `quarantined` are released for good."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import PrivateAttr

from ..types import IslandState
from .views import IslandRecord, IslandView

RECENT = 16  # submissions kept for the "recent" staleness statistics
RETAINED = 64  # released islands listed one by one; older ones are folded into `Retired`


class IslandStats(IslandRecord):
    """The engine's live record of one island (the engine's thread changes it)."""

    index: int
    state: IslandState = IslandState.STARTING
    _recent: deque[int] = PrivateAttr(default_factory=lambda: deque(maxlen=RECENT))  # its newest stalenesses

    def observe_staleness(self, staleness: int) -> None:
        self.staleness_last = staleness
        self.staleness_max = max(self.staleness_max, staleness)
        self.staleness_total += staleness
        self.submissions += 1
        self._recent.append(staleness)

    def view(self) -> IslandView:
        """The island as the status, the control plane and the summary show it."""
        recent = self._recent
        return IslandView(
            **dict(self),
            staleness_mean=self.staleness_total / self.submissions if self.submissions else 0.0,
            staleness_recent_max=max(recent, default=0),
            staleness_recent_mean=sum(recent) / len(recent) if recent else 0.0,
            tokens_per_s=self.tokens / self.compute_s if self.compute_s else 0.0,
        )

    def as_dict(self) -> dict[str, Any]:
        return self.view().model_dump(mode="json", exclude_unset=True)  # what the exporters add is theirs

    def saved(self) -> dict[str, Any]:
        """Plain values for a checkpoint."""
        return {**self.model_dump(mode="json"), "recent": list(self._recent)}

    @classmethod
    def restored(cls, saved: dict[str, Any]) -> IslandStats:
        fields = dict(saved)
        recent = fields.pop("recent", [])
        stats = cls.model_validate(fields)
        stats._recent.extend(recent)
        return stats


@dataclass
class Retired:
    """The totals of released islands no longer listed one by one: a run that replaces
    islands for weeks must not hold (and checkpoint, and serve) every island it ever saw,
    yet its tokens, bytes and staleness still add up."""

    islands: int = 0
    last_index: int = -1  # the highest retired index: a new island never reuses one
    rounds_contributed: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    rejections: int = 0
    downweighted: int = 0
    late_results: int = 0
    submissions: int = 0
    staleness_total: int = 0
    staleness_max: int = 0

    def fold(self, stats: IslandStats) -> None:
        self.islands += 1
        self.last_index = max(self.last_index, stats.index)
        for name in SUMMED:
            setattr(self, name, getattr(self, name) + getattr(stats, name))
        self.staleness_max = max(self.staleness_max, stats.staleness_max)


SUMMED = (
    "rounds_contributed",
    "tokens",
    "compute_s",
    "bytes_sent",
    "bytes_received",
    "rejections",
    "downweighted",
    "late_results",
    "submissions",
    "staleness_total",
)


JOINING = "joining"  # `standing` of an island still being placed


class Membership:
    """The islands of one phase and its target. The engine's thread changes it; the
    control plane's threads read it under the lock (`standing`, `summary`). Operator
    changes arrive through the run's `Inbox` (`engine/commands.py`)."""

    def __init__(self, target: int) -> None:
        self.islands: dict[int, IslandStats] = {}
        self.target = target
        self.pending: dict[int, float] = {}  # island index -> when its placement was requested
        self.retired = Retired()
        self._lock = threading.Lock()

    def standing(self, island: int) -> str | None:
        """An island's state (its value), `JOINING` while it is being placed, None if there
        is no such island."""
        with self._lock:
            stats = self.islands.get(island)
            if stats is not None:
                return stats.state.value
            return JOINING if island in self.pending else None

    # -- the engine's side --------------------------------------------------------------
    def add(self, index: int, node: str, joined_version: int = 0, state: IslandState = IslandState.TRAINING) -> None:
        with self._lock:
            self.pending.pop(index, None)
            self.islands[index] = IslandStats(
                index=index,
                state=state,
                node=node,
                joined_version=joined_version,
                last_progress=time.time(),
            )

    def next_index(self) -> int:
        return max([*self.islands, *self.pending, self.retired.last_index]) + 1

    # -- a checkpoint's part ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The islands (plain values), the released ones' totals and the target."""
        return {
            "members": {i: s.saved() for i, s in self.islands.items()},
            "retired": asdict(self.retired),
            "target": self.target,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Back from `state` (a checkpoint older than a field gives it its default)."""
        for i, saved in state["members"].items():
            self.islands[int(i)] = IslandStats.restored(saved)
        self.retired = Retired(**state.get("retired", {}))
        self.target = state["target"]

    def prune(self, held: set[int]) -> None:
        """Fold all but the newest `RETAINED` released islands into `retired`; islands in
        `held` (work of theirs still waiting to be judged) stay listed."""
        gone = sorted(i for i, s in self.islands.items() if s.state.gone and i not in held)
        if len(gone) <= RETAINED:
            return
        with self._lock:
            for i in gone[: len(gone) - RETAINED]:
                self.retired.fold(self.islands.pop(i))

    def schedulable(self) -> list[int]:
        return [i for i, s in self.islands.items() if s.state == IslandState.TRAINING]

    def live(self) -> list[int]:
        """Islands that count towards the target (draining ones are on their way out)."""
        return [i for i, s in self.islands.items() if s.state in (IslandState.TRAINING, IslandState.LATE)]

    def spares(self) -> list[int]:
        """Hot spares (`elastic.spares`): placed, built, given no work."""
        return [i for i, s in self.islands.items() if s.state == IslandState.SPARE]

    def alive(self) -> list[int]:
        return [i for i, s in self.islands.items() if s.state.alive]

    def mark(self, index: int, state: IslandState, error: str | None = None) -> None:
        self.islands[index].state = state
        if error:
            self.islands[index].error = error

    def summary(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            items = sorted(self.islands.items())
        return {str(i): s.as_dict() for i, s in items}
