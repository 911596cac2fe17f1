"""What the operator asked, taken in between rounds: new settings, pause and resume, and
the stop (logged once). A policy over the inbox that returns the phase the run is in
next; the engine applies it. Membership requests are the fleet's (`fleet.py`)."""

from __future__ import annotations

from .commands import Inbox, SettingsUpdate
from .outputs.persistence import RunCore
from .state.records import EventLog
from .types import Event, RunPhase


class OperatorRequests:
    def __init__(
        self,
        *,
        core: RunCore,
        inbox: Inbox,
        events: EventLog,
        takes_changes: bool,
    ) -> None:
        """`core`: the run's state, which the settings change (H, the outer lr, the quorum
        rule's); `takes_changes`: False in a phase that honours pause and stop only (the
        warm start leaves settings for the run that follows it)."""
        self.cfg, self.inbox, self.run, self.outer, self.quorum = core.cfg, inbox, core.run, core.outer, core.quorum
        self.events, self.takes_changes = events, takes_changes
        self.stop_seen = False

    def heard_stop(self) -> None:
        """Log a stop the inbox accepted, once (its `now` says whether work is abandoned)."""
        if self.inbox.stopping.is_set() and not self.stop_seen:
            self.stop_seen = True
            self.events.add(Event.STOP_REQUESTED, version=self.run.version, now=self.inbox.aborting.is_set())

    def between_rounds(self, phase: RunPhase) -> RunPhase:
        """Apply new settings; the phase after the operator's pause or resume."""
        update = self.inbox.take_settings() if self.takes_changes else None
        if update is not None:
            self.apply(update)
        paused = self.inbox.paused.is_set() and not self.inbox.stopping.is_set()
        if paused and phase == RunPhase.TRAINING:
            self.events.add(Event.PAUSED, version=self.run.version)
            return RunPhase.PAUSED
        if not paused and phase == RunPhase.PAUSED:
            self.events.add(Event.RESUMED, version=self.run.version)
            return RunPhase.TRAINING
        return phase

    def apply(self, update: SettingsUpdate) -> None:
        if update.inner_steps is not None:  # the run's state, checkpointed: the config stays as validated
            self.run.inner_steps = update.inner_steps
        if update.hang_after_steps is not None:
            self.run.hang_after_steps = update.hang_after_steps
        if update.outer_lr is not None:
            self.outer.set_lr(update.outer_lr)
        if self.quorum is not None:
            self.quorum.apply(update)
        self.events.add(Event.SETTINGS, version=self.run.version, **update.model_dump(exclude_none=True))
