"""The coordinator actor: a thin Ray shell over the round engine.

It builds the engine with the Ray island pool and, with `coordinator.shards > 1`, slice
actors (after the warm start's engine, when the run has one to train: `PhasedRun`);
runs it to the end on the actor's main call (`run`), and answers the control
plane on the actor's other threads (`max_concurrency`), where every method only reads a
snapshot or queues a request the engine applies between rounds. If a checkpoint of this
`run_id` exists (Ray restarted this actor, or the user resumed the run) the engine
continues from it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from orchestrator.config import RunConfig
from orchestrator.engine.build import PhasedRun
from orchestrator.engine.controls import SettingsUpdate
from orchestrator.engine.engine import RoundEngine
from orchestrator.engine.policies import check_settings
from orchestrator.engine.types import SliceLost, coordinator_name
from orchestrator.logs import configure
from orchestrator.runtime.island_pool import RayIslandPool, island_bundle
from orchestrator.runtime.slices import start_slices

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(self, cfg: RunConfig, run_id: str = "local", log_level: int | None = None) -> None:
        if log_level is not None:  # the driver's -v/-q, for this process's log file too
            configure(log_level)
        torch.set_num_threads(cfg.coordinator.threads)
        self.cfg, self.run_id = cfg, run_id
        self.metrics: Any = None
        # every phase's islands watch this actor (they release themselves once it is gone)
        self.phases = PhasedRun(
            cfg,
            run_id,
            lambda c, rid: RayIslandPool(c, rid, coordinator_name(run_id)),
            slices=lambda c, params, bounds: start_slices(c, params, bounds, run_id),
            on_record=self._publish_metrics,
        )

    @property
    def engine(self) -> RoundEngine:
        """The phase running now (the warm start's engine, then the run's)."""
        return self.phases.engine

    def _publish_metrics(self, status: dict[str, Any], islands: dict[str, dict[str, Any]]) -> None:
        if self.metrics is not None:
            self.metrics.publish(status, islands)

    def run(self) -> dict[str, Any]:
        from orchestrator.runtime.metrics import RayMetrics

        self.metrics = RayMetrics(self.run_id)  # inside the actor, where Ray is up
        try:
            return self.phases.execute()
        except SliceLost as err:
            # The slice's part of the global state is gone: this process exits so that Ray
            # restarts it (`checkpoint.max_restarts`) and the new coordinator rebuilds every
            # slice from the last checkpoint. Rounds since then are redone, none is lost.
            log.error("%s; restarting the coordinator from its checkpoint", err)
            os._exit(1)
        finally:
            self.engine.pool.close()

    # -- what the control plane calls (other threads) ----------------------------------------
    def _phase(self) -> str:
        return "warm_start" if self.phases.warming else "rounds"

    def progress(self) -> dict[str, Any]:
        return {**self.engine.snapshot, "phase": self._phase()}

    def status(self) -> dict[str, Any]:
        return {**self.engine.status(), "phase": self._phase()}

    def islands(self) -> dict[str, dict[str, Any]]:
        resources = island_bundle(self.engine.cfg)
        return {i: {**s, "resources": resources} for i, s in self.engine.islands_view.items()}

    def events_since(self, index: int = 0, limit: int | None = None) -> list[dict[str, Any]]:
        return self.engine.events.since(index, limit)

    def history(self, since: int = 0, limit: int = 500) -> list[dict[str, Any]]:
        """metrics.jsonl records after round `since`, at most `limit` (for charts)."""
        return self.engine.recorder.page(since, limit)

    def set_target(self, n: int) -> int:
        return self.engine.set_target(n)

    def add_islands(self, n: int) -> int:
        return self.engine.add_islands(n)

    def drain_island(self, island: int) -> None:
        self.engine.members.drain(island)

    def pause(self) -> None:
        self.engine.controls.paused.set()

    def resume(self) -> None:
        self.engine.controls.paused.clear()

    def stop(self, now: bool = False) -> None:
        self.engine.stop(now)

    def update_settings(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Validate now, apply at the next round boundary; returns what will change."""
        update = SettingsUpdate(**changes)
        check_settings(self.cfg, update)
        self.engine.controls.request(update)
        return update.model_dump(exclude_none=True)
