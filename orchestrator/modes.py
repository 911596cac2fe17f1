"""The modes, one registry row each: what a run of each `mode` is made of. A row names the
mode's own config section, picks its pacing and its outer rule from the run's settings,
and declares what the rest of the run needs to know of it, so that no module outside the
registries asks which mode it is in (`tests/test_architecture.py` fails on a comparison
with a mode's name anywhere else). Torch-free and below the config, which validates by
these rows; the engine builds a pacing from `engine/pacing/registry.py`'s row of the kind
chosen here, and an outer rule from `engine/step/rules.py`'s.

| mode        | section        | pacing                                  | outer rule                          | islands' round | besides |
| ----------- | -------------- | --------------------------------------- | ----------------------------------- | -------------- | ------- |
| `diloco`    | `diloco`       | barrier (DyLU: a quorum of every island) | `outer.optimizer`                  | inner steps    | may drop islands' updates (a bench's `simulation.drop_prob`) |
| `ddp`       | none           | gradients                               | the islands' AdamW on the mean gradient | a gradient | no pseudo-gradients |
| `async`     | `asynchronous` | per arrival, or the quorum rule          | `outer.optimizer` or Delayed Nesterov | inner steps  | merges by RDA |
| `overlap`   | `overlap`      | one-round lag                            | CO2                                 | inner steps, or eager | a result lags one version |
| `streaming` | `streaming`    | fragments, or the quorum over segments   | `outer.optimizer`                   | fragments      | islands track the published copy |

Adding a mode is its `Mode` member and one row here (and its section in
`config_sections.py` if it has settings); a pacing or an outer rule it needs is one module
plus one row of that registry, named by a member of `PacingKind` or `RuleKind` below; an
island's round, one class and one row of `workers/runtime/rounds.py`, named by an
`IslandRound`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from archipelago.orchestrator.config_sections import (
    AsyncConfig,
    AsyncRule,
    DilocoConfig,
    OuterConfig,
    OuterMerge,
    OuterOptimizer,
    OverlapConfig,
    StreamingConfig,
    StreamingPacing,
)
from archipelago.workers.wire.spec import IslandRound


class Mode(str, Enum):
    """How rounds are paced and which outer rule steps (one row of `MODES` each)."""

    DILOCO = "diloco"  # barrier rounds, one outer step per round
    DDP = "ddp"  # barrier per batch: the data-parallel baseline
    ASYNC = "async"  # per-arrival: every pseudo-gradient applied when it lands (Delayed Nesterov)
    OVERLAP = "overlap"  # one-round lag: CO2, the exchange of round t hidden behind round t+1
    STREAMING = "streaming"  # Streaming DiLoCo: P fragments synchronised on a staggered schedule


class PacingKind(str, Enum):
    """The pacings (`engine/pacing/registry.py`: one row each)."""

    BARRIER = "barrier"
    DYLU_BARRIER = "dylu_barrier"
    GRADIENTS = "gradients"
    PER_ARRIVAL = "per_arrival"
    QUORUM = "quorum"
    ONE_ROUND_LAG = "one_round_lag"
    FRAGMENTS = "fragments"
    FRAGMENT_QUORUM = "fragment_quorum"


class RuleKind(str, Enum):
    """The outer rules (`engine/step/rules.py`: one row each): the `outer` section's
    optimizers, and the rules a mode brings of its own."""

    NESTEROV = OuterOptimizer.NESTEROV.value
    SGD = OuterOptimizer.SGD.value
    ADAM = OuterOptimizer.ADAM.value
    SPARSELOCO = OuterOptimizer.SPARSELOCO.value
    DELAYED_NESTEROV = "delayed_nesterov"  # mode async, asynchronous.rule delayed_nesterov
    CO2 = "co2"  # mode overlap
    DDP_ADAMW = "ddp_adamw"  # mode ddp: the islands' inner AdamW and schedule, on the mean gradient


class _Shards(Protocol):
    @property
    def shards(self) -> int: ...


class RunSettings(Protocol):
    """What a row reads of a run's config. `RunConfig` is one; a protocol rather than the
    class, because the config validates by these rows and so sits above them."""

    @property
    def mode(self) -> Mode: ...
    @property
    def diloco(self) -> DilocoConfig: ...
    @property
    def asynchronous(self) -> AsyncConfig: ...
    @property
    def streaming(self) -> StreamingConfig: ...
    @property
    def overlap(self) -> OverlapConfig: ...
    @property
    def outer(self) -> OuterConfig: ...
    @property
    def coordinator(self) -> _Shards: ...


def _outer_optimizer(cfg: RunSettings) -> RuleKind:
    return RuleKind(cfg.outer.optimizer.value)


def _mean(_: RunSettings) -> OuterMerge:
    return OuterMerge.MEAN


def _inner(_: RunSettings) -> IslandRound:
    return IslandRound.INNER


def _any_h(_: RunSettings, __: int) -> None:
    return None


@dataclass(frozen=True, kw_only=True)
class ModeSpec:
    """One mode. What it declares is read by capability, never by the mode's name: a new
    mode that steps pseudo-gradients on a lag, say, gets the planner's lagged buffers and
    the config's checks by saying so here."""

    mode: Mode
    section: str | None  # its own settings' section of the config (None: it has none)
    pacing: Callable[[RunSettings], PacingKind]
    rule: Callable[[RunSettings], RuleKind] = _outer_optimizer
    island: Callable[[RunSettings], IslandRound] = (
        _inner  # what its islands do with an order (`workers/runtime/rounds.py`)
    )
    # islands train H inner steps and send Δ for an outer optimizer of the coordinator's own
    # (the DiLoCo family); without it they send one batch's gradient for the islands' own
    # optimizer, stepped on the coordinator: no warm-start fork, no slices, no merge other
    # than the mean, no compressed downlink, no inner state on the islands
    pseudo_gradients: bool = True
    drops: bool = False  # the outer step may drop islands' updates (a bench's ablation: `simulation.drop_prob`)
    tracks_copy: bool = False  # islands always hold the published parameters (not only with a downlink codec)
    fragments: bool = False  # the model is synchronised fragment by fragment (`streaming.fragments`)
    lag: int = 0  # versions by which an island's start lags the version its result is applied to
    merge: Callable[[RunSettings], OuterMerge] = _mean  # `outer.merge: null` resolved
    check_inner_steps: Callable[[RunSettings, int], None] = _any_h  # refuse an H (at launch, and when changed live)


def _diloco_pacing(cfg: RunSettings) -> PacingKind:
    return PacingKind.DYLU_BARRIER if cfg.diloco.dylu else PacingKind.BARRIER


def _async_pacing(cfg: RunSettings) -> PacingKind:
    return PacingKind.QUORUM if cfg.asynchronous.rule == AsyncRule.QUORUM else PacingKind.PER_ARRIVAL


def _async_rule(cfg: RunSettings) -> RuleKind:
    delayed = cfg.asynchronous.rule == AsyncRule.DELAYED_NESTEROV
    return RuleKind.DELAYED_NESTEROV if delayed else _outer_optimizer(cfg)


def _async_merge(_cfg: RunSettings) -> OuterMerge:
    """Radial-Directional Averaging, where it won `bench fleet` (the quorum merges islands
    of different speeds and ages); on one coordinator or its slices alike (they sum each
    island's norm exactly)."""
    return OuterMerge.RADIAL_DIRECTIONAL


def _streaming_pacing(cfg: RunSettings) -> PacingKind:
    quorum = cfg.streaming.pacing == StreamingPacing.QUORUM
    return PacingKind.FRAGMENT_QUORUM if quorum else PacingKind.FRAGMENTS


def _streaming_h(cfg: RunSettings, inner_steps: int) -> None:
    """H a whole number of segments, and τ shorter than one: a fragment leaves after at
    least one step of its segment."""
    s = cfg.streaming
    s.check_inner_steps(inner_steps)
    segment = inner_steps // s.fragments
    if s.tau is not None and s.tau >= segment:
        raise ValueError(
            f"streaming.tau = {s.tau} must be shorter than a segment (inner_steps / fragments = {segment}): "
            "a fragment leaves after at least one step of its segment"
        )


MODES: dict[Mode, ModeSpec] = {
    row.mode: row
    for row in (
        ModeSpec(mode=Mode.DILOCO, section="diloco", pacing=_diloco_pacing, drops=True),
        ModeSpec(
            mode=Mode.DDP,
            section=None,
            pacing=lambda _: PacingKind.GRADIENTS,
            rule=lambda _: RuleKind.DDP_ADAMW,
            island=lambda _: IslandRound.GRADIENT,
            pseudo_gradients=False,
        ),
        ModeSpec(mode=Mode.ASYNC, section="asynchronous", pacing=_async_pacing, rule=_async_rule, merge=_async_merge),
        ModeSpec(
            mode=Mode.OVERLAP,
            section="overlap",
            pacing=lambda _: PacingKind.ONE_ROUND_LAG,
            rule=lambda _: RuleKind.CO2,
            island=lambda cfg: IslandRound.EAGER if cfg.overlap.eager else IslandRound.INNER,
            lag=1,
        ),
        ModeSpec(
            mode=Mode.STREAMING,
            section="streaming",
            pacing=_streaming_pacing,
            island=lambda _: IslandRound.FRAGMENTS,
            tracks_copy=True,
            fragments=True,
            check_inner_steps=_streaming_h,
        ),
    )
}


SECTIONS = tuple(row.section for row in MODES.values() if row.section is not None)  # the mode sections


def mode_of(cfg: RunSettings) -> ModeSpec:
    """The row of a run of `cfg`."""
    return MODES[cfg.mode]


def modes_where(has: Callable[[ModeSpec], bool]) -> str:
    """The modes whose rows have a capability, for an error message ("diloco, async")."""
    return ", ".join(row.mode.value for row in MODES.values() if has(row))
