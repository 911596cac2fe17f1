"""The pacings, one registry row each: when the coordinator takes an outer step and what
it hands out meanwhile. A row builds its `Pacing` and declares what the rest of the run
needs to know of it: how many rounds after it is handed out a piece of work can be
stepped (when an island's inner state must come back for a checkpoint), which staleness
rule admission applies, which settings it takes mid-run, and whether an island's first
work is sized by its speed (then islands probe their speed before joining). Which row a
run uses is `pacing_of(cfg)`: the kind its mode's row picks (`orchestrator/modes.py`).

| row               | config                                   | pacing                                   | staleness  |
| ----------------- | ---------------------------------------- | ---------------------------------------- | ---------- |
| `barrier`         | `mode: diloco`                           | `Barrier`                                | exact      |
| `dylu_barrier`    | `mode: diloco`, `mode.dylu`              | `Quorum` of every island, H per speed    | bounded    |
| `gradients`       | `mode: ddp`                              | `Barrier` of gradients, H steps a record | exact      |
| `per_arrival`     | `mode: async`, rule naive / delayed_nesterov | `PerArrival` (DyLU budget)           | bounded    |
| `quorum`          | `mode: async` (rule quorum)              | `Quorum` + grace window                  | bounded    |
| `one_round_lag`   | `mode: overlap`                          | `OneRoundLag` (CO2)                      | exact (lagged) |
| `fragments`       | `mode: streaming`                        | `FragmentSchedule` over a `Barrier`      | exact      |
| `fragment_quorum` | `mode: streaming`, `mode.pacing: quorum` | `Quorum` over segments                   | bounded    |

Adding a pacing is one module (its `Pacing`), one row here and its `PacingKind` member,
picked by a mode's row. Torch-free: the command
reads `sizes_by_speed` for the islands' specs."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from archipelago.workers.wire.messages import WorkKind

from ...algorithms.dylu import SpeedTracker
from ...config import RunConfig
from ...mode_settings import (
    AsyncSettings,
    OverlapSettings,
    QuorumSettings,
    StalenessSettings,
    StreamingSettings,
)
from ...modes import PacingKind, mode_of, settings_of
from ..step.admission import BoundedStaleness, ExactVersion, StalenessRule
from .arrivals import PerArrival
from .base import Barrier, FragmentSchedule, OneRoundLag, Pacing
from .quorum import Quorum, QuorumRule

QUORUM_SETTINGS = frozenset({"quorum", "grace_cap", "grace_k", "age_power"})  # the quorum rule's, live
ALL = 1 << 30  # a quorum of every live island


@dataclass(frozen=True, kw_only=True)
class PacingRow:
    kind: PacingKind
    build: Callable[[RunConfig, SpeedTracker, QuorumRule | None], Pacing]  # (the run's tracker and rule)
    rounds_ahead: Callable[[int], int]  # schedulable islands -> rounds between handing work out and its step
    bounded_staleness: bool = False  # admission: results of older versions within `mode.max_staleness`
    quorum: Callable[[RunConfig], QuorumRule] | None = None  # its quorum rule (the engine applies changes to it)
    live: frozenset[str] = frozenset()  # the settings it takes mid-run besides everyone's (H, the outer lr)
    sizes_by_speed: Callable[[RunConfig], bool] = lambda _: False  # an island's first work sized by its speed

    def staleness(self, cfg: RunConfig) -> StalenessRule:
        if not self.bounded_staleness:
            return ExactVersion()
        a = settings_of(cfg, StalenessSettings)
        return BoundedStaleness(a.max_staleness, a.stale_policy == "downweight")


def _settings_rule(cfg: RunConfig) -> QuorumRule:
    a = settings_of(cfg, QuorumSettings)
    return QuorumRule(quorum=a.quorum, grace_cap=a.grace_cap, grace_k=a.grace_k, age_power=a.age_power)


def _quorum(cfg: RunConfig, speeds: SpeedTracker, rule: QuorumRule | None, dylu: bool, fragments: bool) -> Pacing:
    assert rule is not None  # the row declares one
    p, tau = _fragments(cfg) if fragments else (0, 0)
    return Quorum(rule, dylu, speeds, cfg.islands.count, cfg.warm_steps, p, tau)


def _fragments(cfg: RunConfig) -> tuple[int, int]:
    """Streaming's P and τ."""
    s = settings_of(cfg, StreamingSettings)
    return s.fragments, s.tau_of(cfg.inner_steps)


def _per_arrival(cfg: RunConfig, speeds: SpeedTracker) -> Pacing:
    a = settings_of(cfg, AsyncSettings)
    return PerArrival(a.dylu, speeds, cfg.islands.count, cfg.warm_steps, a.token_weighted)


def _one(_: int) -> int:
    return 1


def _a_turn(schedulable: int) -> int:
    """About a turn of every island: steps come per arrival."""
    return schedulable + 1


def _quorum_row(kind: PacingKind, *, fragments: bool, rounds_ahead: Callable[[int], int]) -> PacingRow:
    """The quorum rule with its live settings (`mode.*`), over whole rounds or over
    streaming's fragments."""
    return PacingRow(
        kind=kind,
        build=lambda cfg, speeds, rule: _quorum(cfg, speeds, rule, settings_of(cfg, QuorumSettings).dylu, fragments),
        rounds_ahead=rounds_ahead,
        bounded_staleness=True,
        quorum=_settings_rule,
        live=QUORUM_SETTINGS,
        sizes_by_speed=lambda cfg: settings_of(cfg, QuorumSettings).dylu,
    )


PACINGS: dict[PacingKind, PacingRow] = {
    row.kind: row
    for row in (
        PacingRow(
            kind=PacingKind.BARRIER,
            build=lambda cfg, speeds, rule: Barrier(WorkKind.TRAIN, steps_per_record=1),
            rounds_ahead=_one,
        ),
        PacingRow(
            kind=PacingKind.DYLU_BARRIER,
            build=lambda cfg, speeds, rule: _quorum(cfg, speeds, rule, True, False),
            rounds_ahead=_one,
            bounded_staleness=True,
            quorum=lambda _: QuorumRule(quorum=ALL, grace_cap=math.inf, grace_k=0.0, age_power=0.0),
            sizes_by_speed=lambda _: True,
        ),
        PacingRow(
            kind=PacingKind.GRADIENTS,
            build=lambda cfg, speeds, rule: Barrier(WorkKind.GRADIENT, steps_per_record=cfg.inner_steps),
            rounds_ahead=_one,
        ),
        PacingRow(
            kind=PacingKind.PER_ARRIVAL,
            build=lambda cfg, speeds, rule: _per_arrival(cfg, speeds),
            rounds_ahead=_a_turn,
            bounded_staleness=True,
            sizes_by_speed=lambda cfg: settings_of(cfg, AsyncSettings).dylu,
        ),
        _quorum_row(PacingKind.QUORUM, fragments=False, rounds_ahead=_a_turn),
        PacingRow(
            kind=PacingKind.ONE_ROUND_LAG,
            build=lambda cfg, speeds, rule: OneRoundLag(eager=settings_of(cfg, OverlapSettings).eager),
            rounds_ahead=lambda _: 2,
        ),
        PacingRow(
            kind=PacingKind.FRAGMENTS,
            build=lambda cfg, speeds, rule: FragmentSchedule(
                Barrier(WorkKind.TRAIN, steps_per_record=1), *_fragments(cfg)
            ),
            rounds_ahead=_one,
        ),
        _quorum_row(PacingKind.FRAGMENT_QUORUM, fragments=True, rounds_ahead=_one),
    )
}


def pacing_of(cfg: RunConfig) -> PacingRow:
    """The pacing a run of `cfg` uses."""
    return PACINGS[mode_of(cfg).pacing(cfg)]
