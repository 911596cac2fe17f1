"""Distributions a run exposes as Prometheus histograms: how long rounds take and how stale
the judged updates were. A mean hides the tail that matters (one slow round in twenty, a
few updates 30 versions old); the buckets keep it, at a fixed cost whatever the run's
length. Kept by the engine (pure), rendered by the control plane's `/metrics`; Ray's
pipeline observes the same values from each record (`runtime/metrics.py`). Counts start
afresh with a restarted coordinator, as a Prometheus counter does."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

ROUND_SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
# staleness is a whole number of versions; le 0.5 counts the fresh updates (Ray's histograms
# take positive bounds only, and both exporters share these)
STALENESS = (0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0)


@dataclass
class Distribution:
    """Observations per bucket (a value lands in the first bound it does not exceed, the
    last count being +Inf) and their sum."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def view(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total}
