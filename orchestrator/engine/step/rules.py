"""The outer rules, one registry row each: what the coordinator steps on the islands'
mean pseudo-gradient. A row says how to build its optimizer over the flat parameter and
how many values per parameter its state holds (the planner's figure).
Which row a run uses is `rule_of(cfg)`: the kind its mode's row picks
(`orchestrator/modes.py`: the mode's own rule where it has one, else `outer.optimizer`).

Adding a rule is one module (its torch optimizer, in `algorithms/`), one row here and its
`RuleKind` member (with an `OuterOptimizer` member if users choose it by `outer.optimizer`).
The builders import torch when they run: the command reads this module without it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...config import RunConfig
from ...config_sections import OuterConfig
from ...mode_settings import AsyncSettings, OverlapSettings
from ...modes import RuleKind, mode_of, settings_of

if TYPE_CHECKING:
    import torch

    from .outer import OuterRule, Scheduler


@dataclass(frozen=True, kw_only=True)
class RuleRow:
    """One outer rule: either an optimizer of the `outer` section alone (`optimizer`), or a
    mode's own rule built from more of the config (`build`)."""

    kind: RuleKind
    state_values: Callable[[RunConfig], int]  # fp32 values per parameter of its optimizer's state
    optimizer: Callable[[OuterConfig, torch.nn.Parameter], torch.optim.Optimizer] | None = None
    build: Callable[[RunConfig], OuterRule] | None = None
    # whether its step reads the parameters each round in flight started from (CO2's adaptive
    # Λ): the coordinator keeps a copy of each such version (the planner's "round starts")
    anchored: Callable[[RunConfig], bool] = lambda _: False

    def rule(self, cfg: RunConfig) -> OuterRule:
        return self.build(cfg) if self.build is not None else optimizer_rule(cfg.outer)


def _nesterov(o: OuterConfig, p: torch.nn.Parameter) -> torch.optim.Optimizer:
    from ...algorithms.outer import FlatSGD

    return FlatSGD([p], lr=o.lr, momentum=o.momentum, nesterov=o.momentum > 0)


def _sgd(o: OuterConfig, p: torch.nn.Parameter) -> torch.optim.Optimizer:
    from ...algorithms.outer import FlatSGD

    return FlatSGD([p], lr=o.lr, momentum=o.momentum)


def _sparseloco(o: OuterConfig, p: torch.nn.Parameter) -> torch.optim.Optimizer:
    """A plain step: the islands' error feedback is the momentum."""
    from ...algorithms.outer import FlatSGD

    return FlatSGD([p], lr=o.lr)


def _adam(o: OuterConfig, p: torch.nn.Parameter) -> torch.optim.Optimizer:
    from archipelago.workers.runtime.optim import Adam

    return Adam([p], lr=o.lr, betas=o.betas)


def _delayed_nesterov(cfg: RunConfig) -> OuterRule:
    from ...algorithms.outer import DelayedNesterov
    from .outer import OuterRule

    o, a = cfg.outer, settings_of(cfg, AsyncSettings)
    return OuterRule(lambda p: (DelayedNesterov([p], o.lr, o.momentum, a.delay or cfg.islands.count, a.c), None))


def _co2(cfg: RunConfig) -> OuterRule:
    from ...algorithms.outer import CO2Outer, gap_penalty
    from .outer import OuterRule

    o = settings_of(cfg, OverlapSettings)
    return OuterRule(
        lambda p: (CO2Outer([p], o.lr, o.momentum, o.clip), None),
        penalty=gap_penalty(o.penalty, o.penalty_p, o.penalty_lambda),
    )


def _co2_anchored(cfg: RunConfig) -> bool:
    from ...algorithms.outer import gap_penalty

    o = settings_of(cfg, OverlapSettings)
    return gap_penalty(o.penalty, o.penalty_p, o.penalty_lambda).anchored


def _ddp_adamw(cfg: RunConfig) -> OuterRule:
    from archipelago.workers.runtime.optim import build_inner

    from .outer import OuterRule

    # after a warm start its fresh AdamW continues the schedule and re-warms like an island's
    rewarm = cfg.elastic.join_rewarmup_steps if cfg.warm_steps else 0

    from ...algorithms.outer import clip_norm

    def build(p: torch.nn.Parameter) -> tuple[torch.optim.Optimizer, Scheduler]:
        optimizer, schedule = build_inner(cfg.inner, [p], cfg.schedule_steps, cfg.warm_steps, rewarm)
        if cfg.inner.grad_clip is not None:  # the mean gradient clipped, as its inner steps clip theirs
            optimizer.register_step_pre_hook(clip_norm(p, cfg.inner.grad_clip))
        return optimizer, schedule

    return OuterRule(build)


def _momentum_values(cfg: RunConfig) -> int:
    return 1 if cfg.outer.momentum > 0 else 0


RULES: dict[RuleKind, RuleRow] = {
    row.kind: row
    for row in (
        RuleRow(kind=RuleKind.NESTEROV, optimizer=_nesterov, state_values=_momentum_values),
        RuleRow(kind=RuleKind.SGD, optimizer=_sgd, state_values=_momentum_values),
        RuleRow(kind=RuleKind.SPARSELOCO, optimizer=_sparseloco, state_values=lambda _: 0),
        RuleRow(kind=RuleKind.ADAM, optimizer=_adam, state_values=lambda _: 2),
        RuleRow(kind=RuleKind.DELAYED_NESTEROV, build=_delayed_nesterov, state_values=lambda _: 2),
        RuleRow(kind=RuleKind.CO2, build=_co2, state_values=lambda _: 1, anchored=_co2_anchored),
        RuleRow(kind=RuleKind.DDP_ADAMW, build=_ddp_adamw, state_values=lambda _: 2),
    )
}


def rule_of(cfg: RunConfig) -> RuleRow:
    """The outer rule a run of `cfg` steps."""
    return RULES[mode_of(cfg).rule(cfg)]


def outer_rule(cfg: RunConfig) -> OuterRule:
    """How to build the outer optimizer of a run of `cfg` (also built by each coordinator slice)."""
    return dataclasses.replace(rule_of(cfg).rule(cfg), merge=cfg.merge, norm_rows=cfg.compression.chunk)


def optimizer_rule(outer: OuterConfig) -> OuterRule:
    """The rule of the `outer` section alone (`outer.optimizer` and its settings)."""
    from .outer import OuterRule

    return OuterRule(lambda p: (outer_optimizer(outer, p), None), merge=outer.merged)


def outer_optimizer(outer: OuterConfig, param: torch.nn.Parameter) -> torch.optim.Optimizer:
    """`outer.optimizer`'s optimizer over `param`."""
    build = RULES[RuleKind(outer.optimizer.value)].optimizer
    if build is None:
        raise ValueError(f"outer rule {outer.optimizer.value} is a mode's own, not an optimizer of `outer`")
    return build(outer, param)
