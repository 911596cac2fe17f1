"""Failures in time, for the in-process pool: a seeded schedule of crashes, hangs and
slow-downs drawn with exponential gaps (a fleet's mean time between failures), each
striking whichever island is working when it comes — what `bench goodput` runs the
methods through. A crashed or hung island is replaced by the fleet (its rejoin), so the
schedule covers crash, hang, slow-down and rejoin."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np


class Strike(str, Enum):
    CRASH = "crash"  # the island dies: its work is lost, the fleet places a replacement
    HANG = "hang"  # its work never returns: late at its deadline, replaced after the grace
    SLOW = "slow"  # its work in flight and what it starts for `lasts` seconds run `factor`× slower


@dataclass(frozen=True, kw_only=True)
class TimedFault:
    at: float  # the pool's (virtual) clock
    kind: Strike
    factor: float = 1.0
    lasts: float = 0.0


def mttf_schedule(
    *,
    seed: int,
    horizon_s: float,
    mean_gap_s: float,
    hang_share: float = 1 / 3,
    slow_share: float = 1 / 3,
    slow_factor: float = 4.0,
    slow_lasts_s: float = 0.0,
) -> list[TimedFault]:
    """Failures over `horizon_s` with exponential gaps of mean `mean_gap_s` (somewhere in
    the fleet); each a hang with `hang_share`, a slow-down with `slow_share`, else a crash."""
    rng = np.random.default_rng(seed)
    faults: list[TimedFault] = []
    t = 0.0
    while True:
        t += float(rng.exponential(mean_gap_s))
        if t >= horizon_s:
            return faults
        u = float(rng.random())
        kind = Strike.HANG if u < hang_share else Strike.SLOW if u < hang_share + slow_share else Strike.CRASH
        faults.append(TimedFault(at=t, kind=kind, factor=slow_factor, lasts=slow_lasts_s))
