"""Where a phase's start-up goes, measured where it happens, so `bench startup` and
`summary.json` can say which part of "command to first inner step" to work on.

Wall-clock times (`time.time()`): the islands' first steps are stamped by the islands,
and a run's start-up spans processes (the command, the coordinator, the islands)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Startup:
    created_at: float = field(default_factory=time.time)  # the engine was built (its pool asked for islands)
    joined_at: float | None = None  # the last of its first islands joined
    island: dict[str, float] = field(default_factory=dict)  # the slowest island's seconds per part
    first_eval_s: float | None = None  # the evaluation of the start (after the first dispatch)
    began_at: float | None = None  # the first work was handed out
    first_step_at: float | None = None  # an island began its first inner step
    first_outer_at: float | None = None  # the first outer step was taken

    def joined(self, parts: dict[str, float] | None) -> None:
        """An island joined (before training began): its own start-up, part by part."""
        if self.began_at is None:
            self.joined_at = time.time()
            for name, seconds in (parts or {}).items():
                self.island[name] = max(self.island.get(name, 0.0), float(seconds))

    def began(self) -> None:
        self.began_at = time.time()

    def stepped(self, started_at: float | None) -> None:
        if started_at is not None and (self.first_step_at is None or started_at < self.first_step_at):
            self.first_step_at = started_at

    def outer(self) -> None:
        if self.first_outer_at is None:
            self.first_outer_at = time.time()

    def as_dict(self) -> dict[str, Any]:
        def since(start: float | None, end: float | None) -> float | None:
            return end - start if start is not None and end is not None else None

        return {
            "engine_created_at": self.created_at,
            "first_inner_step_at": self.first_step_at,
            "first_outer_step_at": self.first_outer_at,
            "islands_joined_s": since(self.created_at, self.joined_at),
            **{f"island_{name}": seconds for name, seconds in sorted(self.island.items())},
            "first_eval_s": self.first_eval_s,
            "dispatch_to_first_step_s": since(self.began_at, self.first_step_at),
            "engine_to_first_step_s": since(self.created_at, self.first_step_at),
        }
