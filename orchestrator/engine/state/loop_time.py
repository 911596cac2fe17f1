"""Where the coordinator's time goes: the seconds its loop spends in each part of a round,
per recorded round (`coordinator_seconds` in `metrics.jsonl`) and over the run (in
`summary.json`). A round's wall time is the islands' computing plus whatever keeps them
waiting; this says which part of the coordinator's own work that waiting was — the
breakdown `bench streaming` sets beside torchft's. Pure logic."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Part(enum.Enum):
    WAIT = "wait"  # polling the pool for results and joins (fetching a result's envelope included)
    STEP = "step"  # decode, screen, aggregate and the outer step
    PUBLISH = "publish"  # the new version made readable (object store, downlink changes)
    DISPATCH = "dispatch"  # work orders handed out
    EVALUATE = "evaluate"  # the global model's evaluation
    RECORD = "record"  # per-round records, snapshots, a checkpoint's capture
    CHECKPOINT = "checkpoint"  # waiting for a checkpoint: its records' evaluations, its write's end


class LoopClock:
    """Seconds per part, exclusive: a part timed inside another (an evaluation inside a
    record, a publish inside a step) counts for itself only, so the parts add up to the
    loop's time in them."""

    def __init__(self) -> None:
        self.total = dict.fromkeys(Part, 0.0)
        self.window = dict.fromkeys(Part, 0.0)
        self._open: list[list[float]] = []  # per open part: [start, seconds of the parts inside it]

    @contextmanager
    def timed(self, part: Part) -> Iterator[None]:
        frame = [time.perf_counter(), 0.0]
        self._open.append(frame)
        try:
            yield
        finally:
            self._open.pop()
            spent = time.perf_counter() - frame[0]
            own = spent - frame[1]
            self.total[part] += own
            self.window[part] += own
            if self._open:
                self._open[-1][1] += spent

    def take_window(self) -> dict[str, float]:
        """The seconds since the last call (one recorded round's), and a new window."""
        seconds = {p.value: round(s, 6) for p, s in self.window.items()}
        self.window = dict.fromkeys(Part, 0.0)
        return seconds

    def totals(self) -> dict[str, float]:
        return {p.value: round(s, 6) for p, s in self.total.items()}

    def restart(self) -> None:
        """Training (re)starts: what came before it (placement, joins) is start-up, not a round's."""
        self.total = dict.fromkeys(Part, 0.0)
        self.window = dict.fromkeys(Part, 0.0)
