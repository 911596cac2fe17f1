"""Per-island bookkeeping on the coordinator: state, contributions, tokens and bytes.

States: `training` (gets work each round), `late` (missed a round deadline; gets work
again once its overdue result arrives, which is discarded as stale), `draining` (asked to
leave: gets no new work, released once its round is in), `drained` (left), `dead` (actor
or node died, or its code raised), `quarantined` (kept sending bad updates). The last
three are released and never scheduled again."""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

RECENT = 16  # submissions kept for the "recent" staleness statistics


@dataclass
class IslandStats:
    index: int
    state: str = "starting"
    node: str = ""
    rounds_contributed: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_train_loss: float | None = None
    rejections: int = 0
    downweighted: int = 0             # stale submissions applied with a reduced weight (async)
    late_results: int = 0
    error: str | None = None
    joined_version: int = 0           # global version when it joined (0: from the start)
    last_contribution: float | None = None  # wall-clock time of its last applied update
    inner_steps: int = 0              # H of its latest round (DyLU changes it in async mode)
    steps_per_s: float = 0.0          # measured (smoothed) inner steps per second
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
        d["staleness_mean"] = self.staleness_total / self.submissions if self.submissions else 0.0
        d["staleness_recent_max"] = max(self.recent, default=0)
        d["staleness_recent_mean"] = sum(self.recent) / len(self.recent) if self.recent else 0.0
        d["tokens_per_s"] = self.tokens / self.compute_s if self.compute_s else 0.0
        return d


@dataclass
class Membership:
    islands: dict[int, IslandStats] = field(default_factory=dict)

    def add(self, index: int, node: str, joined_version: int = 0) -> None:
        self.islands[index] = IslandStats(index=index, state="training", node=node, joined_version=joined_version)

    def schedulable(self) -> list[int]:
        return [i for i, s in self.islands.items() if s.state == "training"]

    def alive(self) -> list[int]:
        return [i for i, s in self.islands.items() if s.state in ("training", "late", "draining")]

    def mark(self, index: int, state: str, error: str | None = None) -> None:
        self.islands[index].state = state
        if error:
            self.islands[index].error = error

    def summary(self) -> dict[str, dict[str, Any]]:
        return {str(i): s.as_dict() for i, s in sorted(self.islands.items())}
