"""The coordinator actor: a thin Ray shell over the round engine.

It builds the engine with the Ray island pool and, with `coordinator.shards > 1`, slice
actors (after the warm start's engine, when the run has one to train: `PhasedRun`);
runs it to the end on the actor's main call (`run`), and answers the control
plane on the actor's other threads (`max_concurrency`), where every method only reads a
snapshot or queues a request the engine applies between rounds. If a checkpoint of this
`run_id` exists (Ray restarted this actor, or the user resumed the run) the engine
continues from it.

The module imports neither torch nor the engine: the command defines this actor class to
start it, and they would add 0.8 s to its start-up (`bench startup`). The actor's process
imports them when it builds the engine.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from ..config import RunConfig
from ..engine.commands import Answer, Command
from ..engine.types import SliceLost
from ..logs import LogSetup, configure
from .island_actors import island_bundle
from .names import coordinator_name

if TYPE_CHECKING:
    from ..engine.engine import RoundEngine
    from ..engine.policies import Ablation
    from ..engine.state.views import EventRecord, RoundRecord, RunStatus
    from .island_pool import RayIslandPool

log = logging.getLogger(__name__)

# what makes a phase's island pool: (config, run id, the coordinator's actor name) -> pool
IslandPools = Callable[[RunConfig, str, "str | None"], "RayIslandPool"]


class Coordinator:
    def __init__(
        self,
        cfg: RunConfig,
        run_id: str = "local",
        logs: LogSetup | None = None,
        prestarted: int = 0,
        pool: IslandPools | None = None,
        ablation: Ablation | None = None,
    ) -> None:
        """`prestarted`: how many islands the command started for this run before this actor
        (`prestart_islands`); its first pool adopts them, in this process's first life only
        (a restarted coordinator re-attaches to its islands or replaces them, as after any
        restart). `pool`: what makes each phase's pool (default `RayIslandPool`; a
        simulation hands its own, on its clock). `ablation`: a benchmark's change to the
        run's decisions (none for a run of the product)."""
        self._pools = pool
        import torch

        from ..engine.build import PhasedRun
        from .evaluator import start_evaluator
        from .slices import start_slices

        if logs is not None:  # the driver's -v/-q and --log-format, for this process's log file too
            configure(logs.level, fmt=logs.format, run_id=run_id)
        torch.set_num_threads(cfg.coordinator.threads or 1)  # the outer step takes its own (`step_threads`)
        self.cfg, self.run_id = cfg, run_id
        self.metrics: Any = None
        self.tracking: Any = None  # `runtime/tracking.py`, when tracking.backends lists any
        self._events: Any = None  # the event log the trackers follow, and how far
        self._seen = 0
        with warnings.catch_warnings():  # Ray's property reads its own deprecated `actor_id`
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._prestarted = 0 if restarted else prestarted
        if not restarted:  # a restarted coordinator's islands live on, and may be writing
            self._sweep_debris()
        self.phases = PhasedRun(
            cfg,
            run_id,
            self._pool,
            slices=lambda c, params, bounds: start_slices(c, params, bounds, run_id),
            on_record=self._publish_metrics,
            evaluator=lambda c: start_evaluator(c, run_id),
            ablation=ablation,
        )

    def _pool(self, cfg: RunConfig, _phase_id: str) -> RayIslandPool:
        """A phase's pool. Every phase's islands watch this actor (they release themselves
        once it is gone) and are named by the run, not the phase: the main phase takes the
        warm start's over, and finds them by those names after a restart."""
        from .island_pool import RayIslandPool

        pool = (self._pools or RayIslandPool)(cfg, self.run_id, coordinator_name(self.run_id))
        pool.adopt_started(self._prestarted)
        self._prestarted = 0
        return pool

    @property
    def engine(self) -> RoundEngine:
        """The phase running now (the warm start's engine, then the run's)."""
        return self.phases.engine

    def _publish_metrics(self, status: RunStatus, islands: dict[str, dict[str, Any]], record: RoundRecord) -> None:
        if self.metrics is not None:
            self.metrics.publish(status, islands, record)
        if self.tracking is not None and not self.phases.warming:
            events = self.engine.events
            if self._events is not events:  # the main phase's log; a restarted one's from its end
                self._events, self._seen = events, events.count if self.engine.resumed else 0
            new = events.since(self._seen)
            self._seen += len(new)
            self.tracking.record(record, islands, new)

    def run(self) -> dict[str, Any]:
        from .metrics import RayMetrics

        self.metrics = RayMetrics(self.run_id)  # inside the actor, where Ray is up
        if self.cfg.tracking.backends:
            from .tracking import Tracking

            self.tracking = Tracking(self.cfg, self.run_id)
        try:
            summary = self.phases.execute()
            if self.tracking is not None:
                self.tracking.finish(summary)
            return summary
        except SliceLost as err:
            # The slice's part of the global state is gone: this process exits so that Ray
            # restarts it (`checkpoint.max_restarts`) and the new coordinator rebuilds every
            # slice from the last checkpoint. Rounds since then are redone, none is lost.
            log.error("%s; restarting the coordinator from its checkpoint", err)
            os._exit(1)
        finally:
            self.engine.pool.close()  # after the islands' writes were awaited, and they were released
            self._sweep_debris()

    def _sweep_debris(self) -> None:
        """Remove the temporary files writers killed mid-write left anywhere under the run's
        folder: the engine's start sweeps its own (the top folder), this the islands' too
        (`islands/`: an island killed while it streams its inner state left a state-sized
        orphan). Where no writer the run still needs lives: before the first life's islands
        start, and after the last's are released. (A new job resuming the run may adopt
        islands of the one before that are still writing; a temporary of theirs removed
        here only fails that write, which no checkpoint of this life names: the adopted
        island keeps its moments in memory.)"""
        from ..engine.state.checkpoints import run_folder

        folder = run_folder(self.cfg.checkpoint_dir, self.run_id)
        try:
            removed = folder.sweep(deep=True)
        except OSError as err:  # a disk fault: the files stay, the run is not ended for them
            log.warning("the temporary files under %s could not be swept: %s", folder, err)
            return
        if removed:
            log.warning("removed %d temporary file(s) of interrupted writes under %s", len(removed), folder)

    # -- what the control plane calls (other threads) ----------------------------------------
    def progress(self) -> dict[str, Any]:
        return self.phases.progress().as_dict()

    def status(self) -> dict[str, Any]:
        return self.phases.status().as_dict()

    def islands(self) -> dict[str, dict[str, Any]]:
        resources = island_bundle(self.engine.cfg)
        return {i: {**s, "resources": resources} for i, s in self.engine.islands_view.items()}

    def events_since(self, index: int = 0, limit: int | None = None) -> list[EventRecord]:
        return self.engine.events.since(index, limit)

    def history(self, since: int = 0, limit: int = 500) -> list[dict[str, Any]]:
        """metrics.jsonl records after round `since`, at most `limit` (for charts)."""
        return self.engine.recorder.page(since, limit)

    def submit(self, command: Command, key: str | None = None) -> Answer:
        """An operator's command: validated now, answered with an acknowledgement or a
        refusal and its reason; the run applies it at its own pace, in whichever phase.
        `key`: its idempotency key (a key accepted before gets its first answer)."""
        return self.phases.inbox.submit(command, key=key)
