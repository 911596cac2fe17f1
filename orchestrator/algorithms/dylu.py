"""Dynamic Local Updates (Liu et al. 2024; docs/algorithms.md): each island's H from its measured speed, so a
slow island does fewer inner steps and its pseudo-gradients arrive about as often as the
fast islands' — less staleness, no island left behind.

    H_i = max(1, ⌊ v_i / max_j v_j · H ⌋),  v_i = island i's inner steps per second
"""

from __future__ import annotations

import math


def dylu_steps(speeds: dict[int, float], h_max: int) -> dict[int, int]:
    """H per island; islands without a measured speed yet get `h_max`."""
    known = {i: v for i, v in speeds.items() if v > 0}
    if not known:
        return {i: h_max for i in speeds}
    fastest = max(known.values())
    return {i: max(1, math.floor(v / fastest * h_max + 1e-9)) if v > 0 else h_max for i, v in speeds.items()}


class SpeedTracker:
    """Exponentially smoothed inner steps per second of each island (a speed changes when
    a node is shared or throttled, so the estimate must follow it, but not jitter)."""

    def __init__(self, smoothing: float = 0.5) -> None:
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        self.smoothing = smoothing
        self.speeds: dict[int, float] = {}
        self.priors: set[int] = set()  # islands whose speed is still a probe, not a measured round

    def observe(self, island: int, steps: int, seconds: float) -> None:
        if steps <= 0 or seconds <= 0:
            return
        v = steps / seconds
        old = None if island in self.priors else self.speeds.get(island)
        self.priors.discard(island)
        self.speeds[island] = v if old is None else self.smoothing * old + (1 - self.smoothing) * v

    def know(self, island: int, steps_per_s: float) -> None:
        """A speed known (or probed) before the island's first work, so its first H is
        already its own rather than the full H (a slow island's first update would
        otherwise arrive many versions stale). The first measured round replaces it: a
        probe sees compute only, not data loading, so it is not smoothed with real rounds."""
        if steps_per_s > 0:
            self.speeds[island] = steps_per_s
            self.priors.add(island)

    def add(self, island: int) -> None:
        self.speeds.setdefault(island, 0.0)

    def steps(self, h_max: int) -> dict[int, int]:
        return dylu_steps(self.speeds, h_max)
