"""An in-process run handle for API tests: the same protocol as `RayRunHandle`, with the
coordinator's validation rules, over a small in-memory run."""

from __future__ import annotations

import time
from typing import Any

from api.handle import HandleError


class FakeRun:
    def __init__(self, islands: int = 3, max_islands: int = 8) -> None:
        self.target, self.max_islands = islands, max_islands
        self.paused = self.stopped = False
        self.settings = {"inner_steps": 50, "outer_lr": 0.7}
        self.round = 3
        self.log: list[dict[str, Any]] = []
        self.isl = {
            str(i): {
                "state": "training",
                "node": "node-a:cpu",
                "staleness_last": i,
                "staleness_max": 2 * i,
                "inner_steps": 50,
                "steps_per_s": 10.0 - i,
                "tokens": 1000 * (i + 1),
                "rounds_contributed": 3,
                "rejections": 0,
                "last_train_loss": 2.5 + i / 10,
                "bytes_sent": 4096,
                "compute_s": 12.5,
            }
            for i in range(islands)
        }

    def status(self) -> dict[str, Any]:
        return {
            "state": "paused" if self.paused else "training",
            "mode": "diloco",
            "run_id": "fake",
            "round": self.round,
            "rounds": 10,
            "version": self.round,
            "eval_loss": 2.25,
            "tokens": 123456,
            "tokens_per_s": 999.5,
            "bytes_communicated": 10**6,
            "islands_alive": len(self.isl),
            "target_islands": self.target,
            "paused": self.paused,
            **self.settings,
        }

    def islands(self) -> dict[str, dict[str, Any]]:
        return self.isl

    def events(self, since: int, limit: int) -> list[dict[str, Any]]:
        return self.log[since : since + limit]

    def history(self, since: int, limit: int) -> list[dict[str, Any]]:
        return [{"round": r, "eval_loss": 5.0 - r * 0.5} for r in range(since + 1, min(self.round, since + limit) + 1)]

    def set_target(self, n: int) -> int:
        if not 1 <= n <= self.max_islands:
            raise HandleError(422, f"target {n} is outside [1, {self.max_islands}]")
        self.target = n
        self.log.append({"time": time.time(), "kind": "target", "target": n})
        return n

    def add_islands(self, n: int) -> int:
        return self.set_target(self.target + n)

    def drain(self, island: int) -> None:
        if str(island) not in self.isl:
            raise HandleError(404, f"no island {island}")
        self.isl[str(island)]["state"] = "draining"

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def stop(self) -> None:
        self.stopped = True

    def update_settings(self, changes: dict[str, Any]) -> dict[str, Any]:
        self.settings.update(changes)
        return changes
