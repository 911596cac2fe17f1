"""The modes, one registry row each: what a run of each `mode` is made of. A row names the
mode's settings class (`mode_settings.py`: the config's `mode` section is the union of the
rows' classes), picks its pacing and its outer rule from the run's settings, and declares
what the rest of the run needs to know of it, so that no module outside the registries
asks which mode it is in (`tests/test_architecture.py` fails on a comparison with a mode's
name, or a test of the mode settings' class, anywhere else). Torch-free and below the
config, which validates by these rows; the engine builds a pacing from
`engine/pacing/registry.py`'s row of the kind chosen here, and an outer rule from
`engine/step/rules.py`'s.

| mode        | settings            | pacing                                  | outer rule                          | islands' round | besides |
| ----------- | ------------------- | --------------------------------------- | ----------------------------------- | -------------- | ------- |
| `diloco`    | `DilocoSettings`    | barrier (DyLU: a quorum of every island) | `outer.optimizer`                  | inner steps    | may drop islands' updates (a bench's `simulation.drop_prob`) |
| `ddp`       | `DdpSettings`       | gradients                               | the islands' AdamW on the mean gradient | a gradient | no pseudo-gradients |
| `async`     | `AsyncSettings`     | per arrival, or the quorum rule          | `outer.optimizer` or Delayed Nesterov | inner steps  | merges by RDA |
| `overlap`   | `OverlapSettings`   | one-round lag                            | CO2                                 | inner steps, or eager | a result lags one version |
| `streaming` | `StreamingSettings` | fragments, or the quorum over segments   | `outer.optimizer`                   | fragments      | islands track the published copy |

Adding a mode is its `Mode` member, its settings class and one row here; a pacing or an
outer rule it needs is one module plus one row of that registry, named by a member of
`PacingKind` or `RuleKind` below; an island's round, one class and one row of
`workers/runtime/rounds.py`, named by an `IslandRound`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, TypeVar

from archipelago.workers.wire.spec import IslandRound

from .config_sections import OuterConfig, OuterMerge, OuterOptimizer
from .mode_settings import (
    AsyncRule,
    AsyncSettings,
    DdpSettings,
    DilocoSettings,
    Mode,
    ModeSettings,
    OverlapSettings,
    StreamingPacing,
    StreamingSettings,
)


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
    DELAYED_NESTEROV = "delayed_nesterov"  # mode async, mode.rule delayed_nesterov
    CO2 = "co2"  # mode overlap
    DDP_ADAMW = "ddp_adamw"  # mode ddp: the islands' inner AdamW and schedule, on the mean gradient


class RunSettings(Protocol):
    """What a row reads of a run's config. `RunConfig` is one; a protocol rather than the
    class, because the config validates by these rows and so sits above them."""

    @property
    def mode(self) -> ModeSettings: ...
    @property
    def outer(self) -> OuterConfig: ...


S = TypeVar("S", bound=ModeSettings)


class NoSuchSettings(TypeError):
    """A reader asked the run's mode for settings it has none of: a row names a pacing,
    rule or capability its settings class does not carry."""


def settings_of(cfg: RunSettings, kind: type[S]) -> S:
    """The run's mode settings as `kind` (a settings class, or a mixin such as the quorum
    rule's), for a reader that the rows only reach with such a mode."""
    settings = settings_if(cfg, kind)
    if settings is None:
        raise NoSuchSettings(f"mode {cfg.mode.name.value} has no {kind.__name__}")
    return settings


def settings_if(cfg: RunSettings, kind: type[S]) -> S | None:
    """The run's mode settings as `kind`, or None where its mode has none of them."""
    settings = cfg.mode
    return settings if isinstance(settings, kind) else None


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
    settings: type[ModeSettings]  # its settings: its member of the config's `mode` union
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
    fragments: bool = False  # the model is synchronised fragment by fragment (`mode.fragments`)
    lag: int = 0  # versions by which an island's start lags the version its result is applied to
    merge: Callable[[RunSettings], OuterMerge] = _mean  # `outer.merge: null` resolved
    check_inner_steps: Callable[[RunSettings, int], None] = _any_h  # refuse an H (at launch, and when changed live)


def _diloco_pacing(cfg: RunSettings) -> PacingKind:
    return PacingKind.DYLU_BARRIER if settings_of(cfg, DilocoSettings).dylu else PacingKind.BARRIER


def _async_pacing(cfg: RunSettings) -> PacingKind:
    return PacingKind.QUORUM if settings_of(cfg, AsyncSettings).rule == AsyncRule.QUORUM else PacingKind.PER_ARRIVAL


def _async_rule(cfg: RunSettings) -> RuleKind:
    delayed = settings_of(cfg, AsyncSettings).rule == AsyncRule.DELAYED_NESTEROV
    return RuleKind.DELAYED_NESTEROV if delayed else _outer_optimizer(cfg)


def _async_merge(_cfg: RunSettings) -> OuterMerge:
    """Radial-Directional Averaging, where it won `bench fleet` (the quorum merges islands
    of different speeds and ages); on one coordinator or its slices alike (they sum each
    island's norm exactly)."""
    return OuterMerge.RADIAL_DIRECTIONAL


def _streaming_pacing(cfg: RunSettings) -> PacingKind:
    quorum = settings_of(cfg, StreamingSettings).pacing == StreamingPacing.QUORUM
    return PacingKind.FRAGMENT_QUORUM if quorum else PacingKind.FRAGMENTS


def _streaming_h(cfg: RunSettings, inner_steps: int) -> None:
    settings_of(cfg, StreamingSettings).check_inner_steps(inner_steps)


MODES: dict[Mode, ModeSpec] = {
    row.mode: row
    for row in (
        ModeSpec(mode=Mode.DILOCO, settings=DilocoSettings, pacing=_diloco_pacing, drops=True),
        ModeSpec(
            mode=Mode.DDP,
            settings=DdpSettings,
            pacing=lambda _: PacingKind.GRADIENTS,
            rule=lambda _: RuleKind.DDP_ADAMW,
            island=lambda _: IslandRound.GRADIENT,
            pseudo_gradients=False,
        ),
        ModeSpec(mode=Mode.ASYNC, settings=AsyncSettings, pacing=_async_pacing, rule=_async_rule, merge=_async_merge),
        ModeSpec(
            mode=Mode.OVERLAP,
            settings=OverlapSettings,
            pacing=lambda _: PacingKind.ONE_ROUND_LAG,
            rule=lambda _: RuleKind.CO2,
            island=lambda cfg: IslandRound.EAGER if settings_of(cfg, OverlapSettings).eager else IslandRound.INNER,
            lag=1,
        ),
        ModeSpec(
            mode=Mode.STREAMING,
            settings=StreamingSettings,
            pacing=_streaming_pacing,
            island=lambda _: IslandRound.FRAGMENTS,
            tracks_copy=True,
            fragments=True,
            check_inner_steps=_streaming_h,
        ),
    )
}


SETTINGS = tuple(row.settings for row in MODES.values())  # the members of the config's `mode` union


def mode_of(cfg: RunSettings) -> ModeSpec:
    """The row of a run of `cfg`."""
    return MODES[cfg.mode.name]


def modes_where(has: Callable[[ModeSpec], bool]) -> str:
    """The modes whose rows have a capability, for an error message ("diloco, async")."""
    return ", ".join(row.mode.value for row in MODES.values() if has(row))
