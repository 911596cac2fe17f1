"""Failures in time, for the in-process pool: a seeded schedule of crashes, hangs,
slow-downs and preemptions drawn with exponential gaps — each island failing once per
`mttf_s` on average, so a fleet of N islands sees N times as many — each striking
whichever island is working when it comes. A crashed, hung or preempted island is replaced
by the fleet (its rejoin), so the schedule covers crash, hang, slow-down, preemption and
rejoin. What `bench fleet` runs every method through."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import numpy as np


class Strike(str, Enum):
    CRASH = "crash"  # the island dies: its work is lost, the fleet places a replacement
    HANG = "hang"  # its work never returns and it stops reporting progress: found by heartbeats or its deadline
    SLOW = "slow"  # its work in flight and what it starts for `lasts` seconds run `factor`× slower
    PREEMPT = "preempt"  # notice now, the island gone `notice` seconds later (its node drained or reclaimed)


@dataclass(frozen=True, kw_only=True)
class TimedFault:
    at: float  # the pool's (virtual) clock
    kind: Strike
    factor: float = 1.0
    lasts: float = 0.0
    notice: float = 0.0  # a preemption's warning: seconds from `at` until the island is gone


def parse_mix(text: str) -> dict[Strike, float]:
    """`hang=1,crash=1,slow=1,preempt=1` → relative weights of each kind (unnamed: 0)."""
    mix: dict[Strike, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, weight = part.partition("=")
        try:
            kind, w = Strike(name.strip()), float(weight) if sep else 1.0
        except ValueError:
            raise ValueError(f"{part!r}: expected KIND=WEIGHT with KIND one of {[s.value for s in Strike]}") from None
        if w < 0:
            raise ValueError(f"{part!r}: a weight is >= 0")
        mix[kind] = w
    if not sum(mix.values()):
        raise ValueError(f"{text!r}: no failure kind has a weight")
    return mix


def mttf_schedule(
    *,
    seed: int,
    horizon_s: float,
    islands: int,
    mttf_s: float,
    mix: Mapping[Strike, float],
    slow_factor: float = 4.0,
    slow_lasts_s: float = 0.0,
    notice_s: tuple[float, float] = (30.0, 120.0),
) -> list[TimedFault]:
    """Failures over `horizon_s` for `islands` islands failing once per `mttf_s` each on
    average (exponential gaps of `mttf_s / islands` somewhere in the fleet), of the kinds in
    `mix` by weight; a preemption's notice drawn uniformly from `notice_s`."""
    if mttf_s <= 0 or islands < 1:
        raise ValueError(f"need mttf_s > 0 and islands >= 1, got {mttf_s} and {islands}")
    rng = np.random.default_rng(seed)
    kinds = [k for k in Strike if mix.get(k, 0) > 0]
    weights = np.array([mix[k] for k in kinds], dtype=float)
    weights /= weights.sum()
    faults: list[TimedFault] = []
    t = 0.0
    while True:
        t += float(rng.exponential(mttf_s / islands))
        if t >= horizon_s:
            return faults
        kind = kinds[int(rng.choice(len(kinds), p=weights))]
        notice = float(rng.uniform(*notice_s)) if kind == Strike.PREEMPT else 0.0
        faults.append(TimedFault(at=t, kind=kind, factor=slow_factor, lasts=slow_lasts_s, notice=notice))
