"""Operator controls of a running job: pause, resume, stop, and settings changed at the
next round boundary. Requests arrive on other threads (the control plane calls the
coordinator actor concurrently); the loops apply them only at boundaries, so a change
never tears a round in half and is validated before it is accepted."""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.membership import IslandStats

if TYPE_CHECKING:
    from orchestrator.coordinator import Coordinator


class SettingsUpdate(BaseModel):
    """Settings that may change mid-run (validated like the config file)."""

    model_config = ConfigDict(extra="forbid")
    inner_steps: int | None = Field(None, ge=1, le=100_000, description="H from the next round on")
    outer_lr: float | None = Field(None, gt=0, le=100, description="outer learning rate from the next step on")


class RunControls:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.paused = threading.Event()
        self.stopping = threading.Event()
        self.aborting = threading.Event()  # stop now: abandon the round in flight (a job being stopped)
        self.pending: SettingsUpdate | None = None

    def request(self, update: SettingsUpdate) -> None:
        with self.lock:
            merged = (self.pending.model_dump(exclude_none=True) if self.pending else {})
            merged.update(update.model_dump(exclude_none=True))
            self.pending = SettingsUpdate(**merged)

    def boundary(self, co: "Coordinator") -> bool:
        """At a round boundary: apply pending settings, wait while paused. False = stop."""
        with self.lock:
            update, self.pending = self.pending, None
        if update is not None:
            _apply(co, update)
        if self.paused.is_set() and not self.stopping.is_set():
            co.events.add("paused", version=co.server.version)
            co.snapshot["state"] = "paused"
            while self.paused.is_set() and not self.stopping.is_set():
                time.sleep(0.05)
            co.events.add("resumed", version=co.server.version)
            co.snapshot["state"] = "training"
        return not self.stopping.is_set()


def _apply(co: "Coordinator", update: SettingsUpdate) -> None:
    changed = update.model_dump(exclude_none=True)
    if update.inner_steps is not None:
        co.cfg.inner_steps = update.inner_steps
    if update.outer_lr is not None:
        co.server.set_lr(update.outer_lr)
    co.events.add("settings", version=co.server.version, **changed)


class OperatorControls:
    """The coordinator's thread-safe operator methods (what the control plane calls).
    Mixed into `Coordinator`; they only queue requests or read snapshots."""

    def set_target(self, n: int) -> int:
        return self.supervisor.set_target(n)

    def add_islands(self, n: int) -> int:
        return self.supervisor.set_target(self.supervisor.target + n)

    def drain_island(self, island: int) -> None:
        self.supervisor.drain(island)

    def pause(self) -> None:
        self.controls.paused.set()

    def resume(self) -> None:
        self.controls.paused.clear()

    def stop(self, now: bool = False) -> None:
        """Finish the round in flight, checkpoint, write the outputs, end the run. With
        `now` the round in flight is abandoned instead (its data is trained again on
        resume): what `ray job stop` needs, as Ray kills the job a few seconds later."""
        if now:
            self.controls.aborting.set()
        self.controls.stopping.set()
        self.events.add("stop_requested", version=self.server.version, now=now)

    def update_settings(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Validate now, apply at the next round boundary; returns what will change."""
        update = SettingsUpdate(**changes)
        self.controls.request(update)
        return update.model_dump(exclude_none=True)

    def status(self) -> dict[str, Any]:
        return {**self.snapshot, "mode": self.cfg.mode, "run_id": self.run_id, "target_islands": self.supervisor.target,
                "pending_islands": sorted(self.supervisor.pending), "inner_steps": self.cfg.inner_steps,
                "outer_lr": self.server.lr(), "paused": self.controls.paused.is_set(),
                "stopping": self.controls.stopping.is_set()}

    def islands(self) -> dict[str, dict[str, Any]]:
        from orchestrator.launcher import island_bundle

        resources = island_bundle(self.cfg)
        out = {i: {**s, "resources": resources} for i, s in self.members.summary().items()}
        for i in self.supervisor.pending:  # requested, waiting for resources or starting up
            out[str(i)] = {**IslandStats(index=i).as_dict(), "state": "starting", "resources": resources}
        return out

    def events_since(self, index: int = 0) -> list[dict[str, Any]]:
        return self.events.recent[index:]

    def history(self, since: int = 0) -> list[dict[str, Any]]:
        """metrics.jsonl records from round `since` on (for charts)."""
        return [r for r in self.recorder.history if r["round"] > since]
