"""Operator controls of a running job: pause, resume, stop, and settings that change at
the next round boundary. Requests arrive on other threads (the control plane calls the
coordinator actor concurrently); they only set flags or queue a validated update, and
the engine applies them between rounds, so a change never tears a round in half."""

from __future__ import annotations

import threading

from pydantic import BaseModel, ConfigDict, Field


class SettingsUpdate(BaseModel):
    """Settings that may change mid-run (validated like the config file)."""

    model_config = ConfigDict(extra="forbid")
    inner_steps: int | None = Field(None, ge=1, le=100_000, description="H from the next round on")
    outer_lr: float | None = Field(None, gt=0, le=100, description="outer learning rate from the next step on")


class RunControls:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.paused = threading.Event()
        self.stopping = threading.Event()
        self.aborting = threading.Event()  # stop now: abandon the work in flight (a job being stopped)
        self._pending: SettingsUpdate | None = None

    def request(self, update: SettingsUpdate) -> None:
        with self._lock:
            merged = self._pending.model_dump(exclude_none=True) if self._pending else {}
            merged.update(update.model_dump(exclude_none=True))
            self._pending = SettingsUpdate(**merged)

    def take(self) -> SettingsUpdate | None:
        """The settings requested since the last call (merged), for the engine to apply."""
        with self._lock:
            update, self._pending = self._pending, None
        return update

    def stop(self, now: bool) -> None:
        if now:
            self.aborting.set()
        self.stopping.set()
