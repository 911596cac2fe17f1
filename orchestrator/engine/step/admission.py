"""Admission: whether an island's update may touch the global model, and with what weight.

Checks run in a fixed order, cheapest and most certain first: shape, weight, finiteness,
staleness (the pacing's rule: the exact version of the round, or bounded staleness for
asynchronous arrivals), then the statistical checks (weight per step, norm). Only updates that pass all of
them add their norm to the guard's history, so rejected updates never shape the outlier
threshold. An island whose updates are rejected for a fault (not for staleness) several
times in a row is quarantined. Pure logic over the `Facts` of an update, which the outer
step computes from the whole vector or sums over coordinator slices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ...algorithms.robust import NormGuard
from ..types import Contribution, Decision, Reason, Verdict


@dataclass(frozen=True)
class Facts:
    """What admission needs of an update's vector: its length, finiteness and ‖Δ‖²."""

    size: int
    finite: bool
    sqnorm: float


class StalenessRule(Protocol):
    """How old an update may be: returns a verdict that is not `ACCEPT`, or None (fine)."""

    def judge(self, version: int, expected: int, current: int) -> Verdict | None: ...


class ExactVersion:
    """Barrier and one-round-lag rounds: an update must start from the round's version."""

    def judge(self, version: int, expected: int, current: int) -> Verdict | None:
        if version != expected:
            return Verdict(
                Decision.REJECT,
                Reason.STALE,
                f"computed from version {version}, round is at {expected}",
                staleness=max(0, expected - version),
            )
        return None


class BoundedStaleness:
    """Asynchronous arrivals: staleness = versions applied since the island's start;
    beyond `limit` rejected or down-weighted by 1 / (1 + staleness − limit)."""

    def __init__(self, limit: int | None, downweight: bool) -> None:
        self.limit, self.downweight = limit, downweight

    def judge(self, version: int, expected: int, current: int) -> Verdict | None:
        staleness = current - version
        if staleness < 0:
            return Verdict(Decision.REJECT, Reason.FUTURE, f"version {version} > current {current}")
        if self.limit is not None and staleness > self.limit:
            if self.downweight:
                return Verdict(
                    Decision.DOWNWEIGHT,
                    Reason.STALE,
                    f"staleness {staleness} > {self.limit}",
                    1.0 / (1 + staleness - self.limit),
                    staleness,
                )
            return Verdict(
                Decision.REJECT,
                Reason.STALE,
                f"staleness {staleness} > max_staleness {self.limit}",
                staleness=staleness,
            )
        return Verdict(Decision.ACCEPT, staleness=staleness)


class Admission:
    def __init__(
        self,
        numel: int,
        guard: NormGuard | None,
        staleness: StalenessRule,
        quarantine_after: int,
        drop_prob: float = 0.0,
        seed: int = 0,
        fragment_sizes: list[int] | None = None,
    ) -> None:
        """`fragment_sizes`: streaming's fragments, whose updates are checked against their own size."""
        self.numel, self.guard, self.staleness = numel, guard, staleness
        self.fragment_sizes = fragment_sizes or []
        self.quarantine_after = quarantine_after
        self.streak: dict[int, int] = {}
        self.quarantined: set[int] = set()
        self.drop_prob = drop_prob
        self.rng = np.random.default_rng(seed + 7919)

    def judge(self, c: Contribution, facts: Facts, expected: int, current: int) -> Verdict:
        staleness = max(0, current - c.version)
        if c.island in self.quarantined:
            return Verdict(
                Decision.REJECT, Reason.QUARANTINED, f"island {c.island} is quarantined", staleness=staleness
            )
        size = self.numel if c.fragment is None else self.fragment_sizes[c.fragment]
        if facts.size != size:
            return Verdict(Decision.REJECT, Reason.SHAPE, f"wrong shape ({facts.size},), expected ({size},)")
        if not c.weight > 0:
            return Verdict(Decision.REJECT, Reason.WEIGHT, f"non-positive weight {c.weight}")
        if not facts.finite:
            return Verdict(Decision.REJECT, Reason.NON_FINITE, "non-finite values (NaN or inf)")
        verdict = self.staleness.judge(c.version, expected, current) or Verdict(Decision.ACCEPT, staleness=staleness)
        if not verdict.admitted:
            return verdict
        # a fragment's norm as the whole vector's at the same RMS: one history serves all fragments
        norm = math.sqrt(facts.sqnorm * self.numel / size)
        if self.guard is not None:
            per_step = c.weight / max(1, c.steps)
            heavy = self.guard.check_weight(per_step)
            if heavy is not None:
                return Verdict(Decision.REJECT, Reason.WEIGHT, heavy, staleness=verdict.staleness)
            outlier = self.guard.check_norm(norm)
            if outlier is not None:
                return Verdict(Decision.REJECT, Reason.NORM_OUTLIER, outlier, staleness=verdict.staleness)
            self.guard.accept(norm, per_step)
        if self.drop_prob and self.rng.random() < self.drop_prob:
            return Verdict(Decision.DROP, staleness=verdict.staleness)
        return verdict

    def record(self, island: int, verdict: Verdict) -> bool:
        """Count a fault streak; True when this verdict puts `island` in quarantine."""
        fault = verdict.reason is not None and verdict.reason.is_fault and verdict.reason != Reason.QUARANTINED
        self.streak[island] = self.streak.get(island, 0) + 1 if fault else 0
        if fault and self.streak[island] == self.quarantine_after:
            self.quarantined.add(island)
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {
            "norms": list(self.guard.norms) if self.guard else [],
            "weights": list(self.guard.weights) if self.guard else [],
            "streak": dict(self.streak),
            "quarantined": sorted(self.quarantined),
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.guard is not None:
            self.guard.norms.extend(state["norms"])
            self.guard.weights.extend(state.get("weights", []))
        self.streak = {int(i): int(n) for i, n in state["streak"].items()}
        self.quarantined = set(state["quarantined"])
        self.rng.bit_generator.state = state["rng"]
