"""The run's phase (starting, training, paused, and how it ended), owned by one state
machine: the engine moves it, by the transitions below only, and whatever shows it (the
status the control plane serves, the records' snapshot) reads it here instead of keeping
a copy of its own that could fall behind."""

from __future__ import annotations

from collections.abc import Callable

from ..types import RunPhase

ENDINGS = frozenset({RunPhase.FINISHED, RunPhase.STOPPED, RunPhase.FAILED})
NEXT: dict[RunPhase, frozenset[RunPhase]] = {
    # a run stopped (or aborted) while its islands are being placed ends from here too
    RunPhase.STARTING: ENDINGS | {RunPhase.TRAINING},
    RunPhase.TRAINING: ENDINGS | {RunPhase.PAUSED},  # pause: between rounds, as the operator asks
    RunPhase.PAUSED: ENDINGS | {RunPhase.TRAINING},
    # an error while a run that ended writes its last outputs still fails it
    RunPhase.FINISHED: frozenset({RunPhase.FAILED}),
    RunPhase.STOPPED: frozenset({RunPhase.FAILED}),
    RunPhase.FAILED: frozenset(),
}


class PhaseError(RuntimeError):
    """A transition the run's state machine does not have (a bug in the engine, not the
    operator's: their requests are checked by the inbox)."""


class Lifecycle:
    def __init__(self) -> None:
        self.now = RunPhase.STARTING
        self._listeners: list[Callable[[RunPhase], None]] = []

    @property
    def ended(self) -> bool:
        return self.now in ENDINGS

    def listen(self, listener: Callable[[RunPhase], None]) -> None:
        """Call `listener` with each new phase."""
        self._listeners.append(listener)

    def to(self, phase: RunPhase) -> None:
        """Move to `phase` (staying is no move); PhaseError if the machine has no such step."""
        if phase == self.now:
            return
        if phase not in NEXT[self.now]:
            raise PhaseError(f"the run cannot go from {self.now.value} to {phase.value}")
        self.now = phase
        for listener in self._listeners:
            listener(phase)
