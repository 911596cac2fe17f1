"""The one place where the run's mode is branched: it picks the pacing, the staleness rule
of admission and the outer rule. Everything downstream (engine, outer step, coordinator
slices, runtime) works with whatever is chosen here.

| mode      | pacing        | staleness rule      | outer rule                                  |
| --------- | ------------- | ------------------- | ------------------------------------------- |
| `diloco`  | Barrier       | exact version       | Nesterov / SGD (`FlatSGD`) or Adam          |
| `ddp`     | Barrier/batch | exact version       | the inner AdamW + schedule on mean gradients |
| `async`   | Quorum        | bounded staleness   | Nesterov / SGD / Adam on the age-weighted mean |
| `async`, delayed_nesterov / naive | PerArrival | bounded staleness | `DelayedNesterov`, or Nesterov per arrival |
| `diloco`, `diloco.dylu` | Quorum of every island (a barrier, H per speed) | bounded staleness | as `diloco` |
| `overlap` | OneRoundLag   | exact (lagged) ver. | `CO2Outer`                                  |
| `streaming` | FragmentSchedule (a Barrier over segments, Δ taken τ steps early) | exact version | Nesterov / SGD / Adam per fragment |
| `streaming`, `streaming.pacing: quorum` | Quorum over segments, a step per fragment present | bounded staleness | as `streaming` |

The outer rules are torch optimizers, imported by the functions that build them: the
command (`archipelago run`) asks this module what an island's spec holds
(`sizes_first_work_by_speed`) and never needs torch (0.8 s of its start-up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.algorithms.dylu import SpeedTracker
from orchestrator.algorithms.robust import NormGuard
from orchestrator.config import Mode, RunConfig
from orchestrator.config_sections import AsyncRule, OuterConfig, StreamingPacing
from orchestrator.engine.admission import Admission, BoundedStaleness, ExactVersion, StalenessRule
from orchestrator.engine.arrivals import PerArrival
from orchestrator.engine.commands import Inbox, SettingsUpdate
from orchestrator.engine.pacing import Barrier, FragmentSchedule, OneRoundLag, Pacing
from orchestrator.engine.quorum import Quorum, QuorumRule
from workers.wire.messages import WorkKind

if TYPE_CHECKING:
    import torch

    from orchestrator.engine.outer_step import OuterRule, Scheduler
    from workers.wire.fragments import Fragments


def outer_optimizer(cfg: OuterConfig, param: torch.nn.Parameter) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: Nesterov by default; SGD with lr 1, momentum 0 is plain averaging."""
    from orchestrator.algorithms.outer import FlatSGD
    from workers.runtime.optim import Adam

    if cfg.optimizer == "nesterov":
        return FlatSGD([param], lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0)
    if cfg.optimizer == "sgd":
        return FlatSGD([param], lr=cfg.lr, momentum=cfg.momentum)
    if cfg.optimizer == "sparseloco":  # the islands' error feedback is the momentum
        return FlatSGD([param], lr=cfg.lr)
    return Adam([param], lr=cfg.lr, betas=cfg.betas)


def outer_rule(cfg: RunConfig) -> OuterRule:
    """The outer rule of `cfg.mode` (also built by each coordinator slice)."""
    from orchestrator.algorithms.outer import CO2Outer, DelayedNesterov
    from orchestrator.engine.outer_step import OuterRule
    from workers.runtime.optim import build_inner

    def plain(param: torch.nn.Parameter) -> tuple[torch.optim.Optimizer, Scheduler | None]:
        return outer_optimizer(cfg.outer, param), None

    if cfg.mode == Mode.DDP:
        # after a warm start its fresh AdamW continues the schedule and re-warms like an island's
        rewarm = cfg.elastic.join_rewarmup_steps if cfg.warm_steps else 0
        return OuterRule(
            lambda p: build_inner(cfg.inner, [p], cfg.schedule_steps, cfg.warm_steps, rewarm),
            grad_clip=cfg.inner.grad_clip,
        )
    if cfg.mode == Mode.ASYNC:
        a = cfg.asynchronous
        if a.rule in (AsyncRule.NAIVE, AsyncRule.QUORUM):
            return OuterRule(plain)
        return OuterRule(
            lambda p: (DelayedNesterov([p], cfg.outer.lr, cfg.outer.momentum, a.delay or cfg.islands.count, a.c), None)
        )
    if cfg.mode == Mode.OVERLAP:
        o = cfg.overlap
        return OuterRule(
            lambda p: (CO2Outer([p], o.lr, o.momentum, o.clip, o.penalty, o.penalty_p, o.penalty_lambda), None),
            anchored=True,
        )
    return OuterRule(plain)


def check_settings(cfg: RunConfig, update: SettingsUpdate, islands: int) -> None:
    """Refuse (ValueError: a 422 from the control plane) a settings change the mode
    cannot take: streaming's H must stay a whole number of segments; the quorum rule's
    settings need that rule, and a quorum no more than the `islands` the run targets."""
    if cfg.mode == Mode.STREAMING and update.inner_steps is not None:
        cfg.streaming.check_inner_steps(update.inner_steps)
    asked = [k for k in ("quorum", "grace_cap", "grace_k", "age_power") if getattr(update, k) is not None]
    if asked and not runs_quorum(cfg):
        raise ValueError(
            f"{', '.join(asked)}: needs mode async with asynchronous.rule = quorum, "
            "or mode streaming with streaming.pacing = quorum"
        )
    cfg.asynchronous.check_quorum(update.quorum, islands)


def runs_quorum(cfg: RunConfig) -> bool:
    """Whether `cfg` paces its steps by the (live-tunable) quorum rule."""
    if cfg.mode == Mode.STREAMING:
        return cfg.streaming.pacing == StreamingPacing.QUORUM
    return cfg.mode == Mode.ASYNC and cfg.asynchronous.rule == AsyncRule.QUORUM


def quorum_rule(cfg: RunConfig) -> QuorumRule | None:
    """The quorum pacing's live settings for `cfg`, or None if it runs none (sync_dylu is
    a quorum of every island with no window cap)."""
    a = cfg.asynchronous
    if runs_quorum(cfg):
        return QuorumRule(quorum=a.quorum, grace_cap=a.grace_cap, grace_k=a.grace_k, age_power=a.age_power)
    if cfg.mode == Mode.DILOCO and cfg.diloco.dylu:
        return QuorumRule(quorum=ALL, grace_cap=math.inf, grace_k=0.0, age_power=0.0)
    return None


ALL = 1 << 30  # a quorum of every live island


def sizes_first_work_by_speed(cfg: RunConfig) -> bool:
    """Whether the pacing gives an island its first work by its speed (Dynamic Local
    Updates): then a new island's speed is probed before it joins, or a slow island's first
    update would be a full H and arrive many versions stale. Elsewhere every island gets
    the same H and the first round measures the speed (a probe would only delay the start)."""
    if quorum_rule(cfg) is not None:
        return cfg.asynchronous.dylu if cfg.mode != Mode.DILOCO else True
    return cfg.mode == Mode.ASYNC and cfg.asynchronous.dylu


def run_inbox(cfg: RunConfig) -> Inbox:
    """The inbox of a run of `cfg`: its island bounds, and the settings its mode can take."""
    return Inbox(
        target=cfg.islands.count,
        min_islands=cfg.elastic.min_islands,
        max_islands=cfg.elastic.max_islands,
        check=lambda update, islands: check_settings(cfg, update, islands),
    )


@dataclass(frozen=True)
class Policies:
    pacing: Pacing
    admission: Admission
    speeds: SpeedTracker  # islands' measured steps/s: the engine feeds it, DyLU and the operator read it
    quorum: QuorumRule | None = None  # the quorum pacing's live settings (the engine applies changes to it)


def build_policies(cfg: RunConfig, numel: int, fragments: Fragments | None = None) -> Policies:
    staleness: StalenessRule = ExactVersion()
    speeds = SpeedTracker(cfg.asynchronous.speed_smoothing)
    pacing: Pacing
    a = cfg.asynchronous
    rule = quorum_rule(cfg)
    if rule is not None:
        dylu = a.dylu if cfg.mode != Mode.DILOCO else True
        p, tau = (cfg.streaming.fragments, cfg.streaming_tau) if cfg.mode == Mode.STREAMING else (0, 0)
        pacing = Quorum(rule, dylu, speeds, cfg.islands.count, cfg.warm_steps, p, tau)
        staleness = BoundedStaleness(a.max_staleness, a.stale_policy == "downweight")
    elif cfg.mode == Mode.ASYNC:
        pacing = PerArrival(a.dylu, speeds, cfg.islands.count, cfg.warm_steps, a.token_weighted)
        staleness = BoundedStaleness(a.max_staleness, a.stale_policy == "downweight")
    elif cfg.mode == Mode.OVERLAP:
        pacing = OneRoundLag(eager=cfg.overlap.eager)
    elif cfg.mode == Mode.DDP:
        pacing = Barrier(WorkKind.GRADIENT, steps_per_record=cfg.inner_steps)
    elif cfg.mode == Mode.STREAMING:
        segments = Barrier(WorkKind.TRAIN, steps_per_record=1)
        pacing = FragmentSchedule(segments, cfg.streaming.fragments, cfg.streaming_tau)
    else:
        pacing = Barrier(WorkKind.TRAIN, steps_per_record=1)
    admission = Admission(
        numel,
        NormGuard(cfg.robust),
        staleness,
        cfg.robust.quarantine_after,
        cfg.outer.drop_prob,
        cfg.seed,
        [fragments.size(p) for p in range(fragments.count)] if fragments else None,
    )
    return Policies(pacing, admission, speeds, rule)
