"""The run's policies, chosen from its config once: the pacing and the staleness rule of
admission (a row of `pacing/registry.py`), the outer rule (a row of `step/rules.py`), and the
inbox with the settings the pacing takes mid-run. Everything downstream (engine, outer
step, coordinator slices, runtime) works with whatever is chosen here.

Torch-free: the command asks this module what an island's spec holds
(`sizes_first_work_by_speed`) and never needs torch (0.8 s of its start-up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..algorithms.dylu import SpeedTracker
from ..algorithms.robust import NormGuard
from ..config import RunConfig
from ..mode_settings import check_quorum
from ..modes import mode_of
from .commands import Inbox, SettingsUpdate
from .pacing.base import Pacing
from .pacing.quorum import QuorumRule
from .pacing.registry import QUORUM_SETTINGS, pacing_of
from .step.admission import Admission

if TYPE_CHECKING:
    from archipelago.workers.wire.fragments import Fragments


def check_settings(cfg: RunConfig, update: SettingsUpdate, islands: int) -> None:
    """Refuse (ValueError: a 422 from the control plane) a settings change the run's pacing
    cannot take: streaming's H must stay a whole number of segments; the quorum rule's
    settings need a pacing that runs it, and a quorum no more than the `islands` the run
    targets."""
    if update.inner_steps is not None:
        mode_of(cfg).check_inner_steps(cfg, update.inner_steps)
    row = pacing_of(cfg)
    asked = [k for k in sorted(QUORUM_SETTINGS) if getattr(update, k) is not None and k not in row.live]
    if asked:
        raise ValueError(
            f"{', '.join(asked)}: needs mode async with mode.rule = quorum, or mode streaming with mode.pacing = quorum"
        )
    if update.hang_after_steps is not None and cfg.elastic.hang_after_steps is None:
        raise ValueError(
            "hang_after_steps: the run has no heartbeats (elastic.hang_after_steps: null in its config); "
            "it can change their threshold, not turn them on"
        )
    check_quorum(update.quorum, islands)


def sizes_first_work_by_speed(cfg: RunConfig) -> bool:
    """Whether the pacing gives an island its first work by its speed (Dynamic Local
    Updates): then a new island's speed is probed before it joins, or a slow island's first
    update would be a full H and arrive many versions stale. Elsewhere every island gets
    the same H and the first round measures the speed (a probe would only delay the start)."""
    return pacing_of(cfg).sizes_by_speed(cfg)


def run_inbox(cfg: RunConfig) -> Inbox:
    """The inbox of a run of `cfg`: its island bounds, and the settings its mode can take."""
    return Inbox(
        target=cfg.islands.count,
        min_islands=cfg.elastic.min_islands,
        max_islands=cfg.elastic.max_islands,
        check=lambda update, islands: check_settings(cfg, update, islands),
    )


@dataclass(frozen=True, kw_only=True)
class Ablation:
    """What a benchmark changes in a run's decisions and no run's config says: the seam the
    simulator and `archipelago bench` use (`SimulationConfig.ablation`), handed to the
    composition root (`build_engine`); `archipelago run` never sets it, so a run of the
    product drops nothing and never stands its fleet still."""

    # the outer step leaves out each update it admitted with this probability (the DiLoCo
    # paper's dropped pseudo-gradients, as a `Decision.DROP`)
    drop_prob: float = 0.0
    # every island failure halts the whole fleet this long, its work not yet stepped given
    # up: the checkpoint-restart baseline (Ray Train restarting a job), None: never
    restart_s: float | None = None


@dataclass(frozen=True)
class Policies:
    pacing: Pacing
    admission: Admission
    speeds: SpeedTracker  # islands' measured steps/s: the engine feeds it, DyLU and the operator read it
    quorum: QuorumRule | None = None  # the quorum pacing's live settings (the engine applies changes to it)


def build_policies(
    cfg: RunConfig, numel: int, fragments: Fragments | None = None, ablation: Ablation | None = None
) -> Policies:
    """The run's pacing (its registry row, `pacing/registry.py`), admission with the row's
    staleness rule (and a benchmark's drops, `ablation`), and the speed tracker they share."""
    row = pacing_of(cfg)
    speeds = SpeedTracker(cfg.speed_smoothing)
    rule = row.quorum(cfg) if row.quorum is not None else None
    admission = Admission(
        numel,
        NormGuard(cfg.robust),
        row.staleness(cfg),
        cfg.robust.quarantine_after,
        ablation.drop_prob if ablation is not None else 0.0,
        cfg.seed,
        [fragments.size(p) for p in range(fragments.count)] if fragments else None,
    )
    return Policies(row.build(cfg, speeds, rule), admission, speeds, rule)
