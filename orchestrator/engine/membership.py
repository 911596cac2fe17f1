"""Who is in the run: per-island bookkeeping (state, contributions, tokens, bytes,
staleness), the target island count, joins still being placed, and the operator's
membership requests. Pure logic; the engine applies requests at its own pace (a change
never tears a round in half) and the island pool does the placing.

States are `IslandState` (see `engine/types.py`): `training` gets work, `late` gets work
again once its overdue result arrives (and is discarded), `draining` finishes or abandons
its work and is released, `drained`, `dead` and `quarantined` are released for good."""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from orchestrator.engine.types import IslandState

RECENT = 16  # submissions kept for the "recent" staleness statistics


@dataclass
class IslandStats:
    index: int
    state: IslandState = IslandState.STARTING
    node: str = ""
    rounds_contributed: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_train_loss: float | None = None
    rejections: int = 0
    downweighted: int = 0  # stale submissions applied with a reduced weight (async)
    late_results: int = 0
    error: str | None = None
    joined_version: int = 0  # global version when it joined (0: from the start)
    last_contribution: float | None = None  # wall-clock time of its last applied update
    inner_steps: int = 0  # H of its latest round (DyLU changes it in async mode)
    steps_per_s: float = 0.0  # measured (smoothed) inner steps per second
    staleness_last: int = 0
    staleness_max: int = 0
    staleness_total: int = 0
    submissions: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT), repr=False)

    def observe_staleness(self, staleness: int) -> None:
        self.staleness_last = staleness
        self.staleness_max = max(self.staleness_max, staleness)
        self.staleness_total += staleness
        self.submissions += 1
        self.recent.append(staleness)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "recent"}
        d["state"] = self.state.value
        d["staleness_mean"] = self.staleness_total / self.submissions if self.submissions else 0.0
        d["staleness_recent_max"] = max(self.recent, default=0)
        d["staleness_recent_mean"] = sum(self.recent) / len(self.recent) if self.recent else 0.0
        d["tokens_per_s"] = self.tokens / self.compute_s if self.compute_s else 0.0
        return d


class MembershipError(ValueError):
    """An operator's membership request that cannot be honoured (the API answers 4xx)."""


class Membership:
    """Thread-safe for the operator's calls (`set_target`, `add_islands`, `drain`), which only
    queue a request; everything else runs on the engine's thread.

    `requested` is the target once every queued request is applied. Operator calls read and
    move it under the lock, so two adds in one round make +2 (not both "target 4 from 3"),
    a PUT then an add compose, and a drain that would go below `min_islands` is refused when
    asked, not discovered rounds later when the run has no island left."""

    def __init__(self, target: int, min_islands: int, max_islands: int) -> None:
        self.islands: dict[int, IslandStats] = {}
        self.target = self.requested = target
        self.min_islands, self.max_islands = min_islands, max_islands
        self.pending: dict[int, float] = {}  # island index -> when its placement was requested
        self.requests: queue.Queue[tuple[str, int]] = queue.Queue()
        self._lock = threading.Lock()

    # -- requests from other threads ---------------------------------------------------
    def _bounded(self, n: int) -> int:
        if not self.min_islands <= n <= self.max_islands:
            raise MembershipError(
                f"target {n} is outside [elastic.min_islands, elastic.max_islands] = "
                f"[{self.min_islands}, {self.max_islands}]"
            )
        return n

    def set_target(self, n: int) -> int:
        with self._lock:
            self.requested = self._bounded(n)
            self.requests.put(("target", n))
        return n

    def add_islands(self, n: int) -> int:
        with self._lock:
            self.requested = self._bounded(self.requested + n)
            self.requests.put(("target", self.requested))
            return self.requested

    def drain(self, island: int) -> None:
        """Ask `island` to leave (it is not replaced: the target drops by one); an island
        still joining is cancelled instead."""
        with self._lock:
            stats = self.islands.get(island)
            if stats is None and island not in self.pending:
                raise KeyError(f"no island {island}")
            if stats is not None and stats.state not in (IslandState.TRAINING, IslandState.LATE):
                raise MembershipError(f"island {island} is {stats.state.value}, not training")
            if self.requested - 1 < self.min_islands:
                raise MembershipError(
                    f"draining island {island} would leave {self.requested - 1} islands, "
                    f"below elastic.min_islands = {self.min_islands}"
                )
            self.requested -= 1
            self.requests.put(("drain", island))

    def take_requests(self) -> list[tuple[str, int]]:
        out = []
        while not self.requests.empty():
            out.append(self.requests.get_nowait())
        return out

    def settle(self) -> None:
        """After the engine applied the requests: with none queued, `requested` is the target
        (a drain that found its island already gone did not lower it)."""
        with self._lock:
            if self.requests.empty():
                self.requested = self.target

    # -- the engine's side --------------------------------------------------------------
    def add(self, index: int, node: str, joined_version: int = 0) -> None:
        with self._lock:
            self.pending.pop(index, None)
            self.islands[index] = IslandStats(
                index=index, state=IslandState.TRAINING, node=node, joined_version=joined_version
            )

    def next_index(self) -> int:
        return max([*self.islands, *self.pending], default=-1) + 1

    def schedulable(self) -> list[int]:
        return [i for i, s in self.islands.items() if s.state == IslandState.TRAINING]

    def live(self) -> list[int]:
        """Islands that count towards the target (draining ones are on their way out)."""
        return [i for i, s in self.islands.items() if s.state in (IslandState.TRAINING, IslandState.LATE)]

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
