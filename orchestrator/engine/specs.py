"""What the engine hands each island: its `IslandSpec`, from the run config.

A module of its own, free of torch, because the command (`archipelago run`) builds the
specs of a new run's first islands to start them beside the coordinator
(`prestart_islands`), and the coordinator's pool must ask for exactly the same specs to
adopt them."""

from __future__ import annotations

from archipelago.workers.runtime.island_spec import IslandSpec
from archipelago.workers.wire.messages import SavedState

from ..config import RunConfig
from ..mode_settings import OverlapSettings, StreamingSettings
from ..modes import mode_of, settings_if
from .policies import sizes_first_work_by_speed
from .warm_start import version0_file


def island_spec(
    cfg: RunConfig,
    index: int,
    start_step: int = 0,
    *,
    state_folder: str | None = None,
    restore: SavedState | None = None,
) -> IslandSpec:
    """What island `index` is built from (an island that starts past step 0 of the run's
    inner schedule — a joiner, a promoted spare, or any island after a warm start —
    re-warms its learning rate while its fresh optimizer state settles; one that
    continues from its saved state, `restore`, has no fresh state to settle)."""
    stream, co2 = settings_if(cfg, StreamingSettings), settings_if(cfg, OverlapSettings)
    return IslandSpec(
        index=index,
        num_islands=cfg.islands.count,
        seed=cfg.seed,
        task_factory=cfg.task.factory,
        task_kwargs=dict(cfg.task.kwargs),
        inner=cfg.inner,
        total_inner_steps=cfg.schedule_steps,
        threads=cfg.island_threads,
        codec=cfg.compression.codec,
        chunk=cfg.compression.chunk,
        num_shards=cfg.num_shards,
        start_step=start_step,
        # kept for an island placed at step 0 too: a spare promoted later starts past it
        rewarmup_steps=cfg.elastic.join_rewarmup_steps if restore is None else 0,
        coordinator_shards=cfg.coordinator.slices,
        sharding=cfg.islands.sharding,
        error_feedback=cfg.compression.error_feedback,
        feedback_decay=cfg.compression.feedback_decay,
        round=mode_of(cfg).island(cfg),
        tracks_copy=cfg.tracks_copy,
        fragments=stream.fragments if stream is not None else 0,
        merge_alpha=stream.alpha if stream is not None else 0.0,
        eager_step=co2.lr / co2.penalty_p if co2 is not None and co2.eager else 0.0,
        eager_clip=co2.clip if co2 is not None else None,
        state_folder=state_folder,
        restore_state=restore,
        probe=sizes_first_work_by_speed(cfg),
        builds_version0=cfg.islands.build_version0,
        version0_file=str(path) if (path := version0_file(cfg)) is not None else None,
    )
