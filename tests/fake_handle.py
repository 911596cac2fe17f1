"""An in-process run handle for API tests: the same protocol as `RayRunHandle`, over a small
in-memory run whose commands go through the engine's own `Inbox` (the same validation,
bounds and refusal reasons as a real run), applied at once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from archipelago.orchestrator.engine.commands import (
    Ack,
    AddIslands,
    Answer,
    Command,
    Drain,
    Inbox,
    Pause,
    Preempt,
    Resume,
    SetTarget,
    SettingsUpdate,
    Stop,
    UpdateSettings,
)
from archipelago.orchestrator.engine.state.membership import IslandStats, Membership
from archipelago.orchestrator.engine.types import Event, IslandState

# the event a real run logs when it takes each command
LOGGED_AS = {
    SetTarget: Event.TARGET,
    AddIslands: Event.TARGET,
    Drain: Event.DRAIN,
    Preempt: Event.PREEMPTING,
    Pause: Event.PAUSED,
    Resume: Event.RESUMED,
    Stop: Event.STOP_REQUESTED,
    UpdateSettings: Event.SETTINGS,
}


class FakeRun:
    def __init__(self, islands: int = 3, max_islands: int = 8) -> None:
        self.members = Membership(islands)
        for i in range(islands):
            self.members.islands[i] = IslandStats(index=i, state=IslandState.TRAINING)
        self.inbox = Inbox(target=islands, min_islands=1, max_islands=max_islands, check=lambda _update, _islands: None)
        self.inbox.members = self.members
        self.stopped = False
        self.settings: dict[str, Any] = {"inner_steps": 50, "outer_lr": 0.7}
        self.round = 3
        self.joined: dict[str, int] = {}  # island -> its first round in the history (absent: from the start)
        self.left: dict[str, int] = {}  # island -> its last round in the history (absent: still there)
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
                "merge": "training",
                "last_progress": time.time() - 1.0,
                "last_contribution": time.time() - 3.0,
            }
            for i in range(islands)
        }

    @property
    def target(self) -> int:
        return self.inbox.requested

    @property
    def paused(self) -> bool:
        return self.inbox.paused.is_set()

    def status(self) -> dict[str, Any]:
        return {
            "state": "paused" if self.paused else "training",
            "phase": "main",
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
        return [self.record(r) for r in range(since + 1, min(self.round, since + limit) + 1)]

    def record(self, rnd: int) -> dict[str, Any]:
        """Round `rnd`'s record: every island present then sent a result `(rnd + i) % 3`
        versions behind and computed `2 - i / 2` s of its 2.5 s round."""
        present = [i for i in self.isl if rnd >= self.joined.get(i, 0) and rnd <= self.left.get(i, rnd)]
        return {
            "round": rnd,
            "version": rnd,
            "eval_loss": 5.0 - rnd * 0.5,
            "round_seconds": 2.5,
            "island_staleness": {i: (rnd + int(i)) % 3 for i in present},
            "island_compute_seconds": {i: rnd * (2.0 - int(i) / 2) for i in present},
            "island_idle_fraction": {i: 1 - (2.0 - int(i) / 2) / 2.5 for i in present},
        }

    def submit(self, command: Command, key: str | None = None) -> Answer:
        """The inbox's answer; what it accepted is applied at once (a real run applies it at
        its next step or round boundary)."""
        reply = self.inbox.submit(command, key=key)
        if isinstance(reply, Ack):
            self.log.append({"time": time.time(), "kind": LOGGED_AS[type(command)].value, **reply.detail})
            for change in self.inbox.take_membership():
                if isinstance(change, (Drain, Preempt)):
                    self.members.islands[change.island].state = IslandState.DRAINING
                    self.isl[str(change.island)]["state"] = "draining"
            update: SettingsUpdate | None = self.inbox.take_settings()
            if update is not None:
                self.settings.update(update.model_dump(exclude_none=True))
            self.stopped = self.stopped or isinstance(command, Stop)
        return reply


TOKEN = "s3cret-token"  # the API token of the served fake run (`served`)
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@contextmanager
def served(token: str | None = TOKEN) -> Iterator[tuple[httpx.Client, FakeRun]]:
    """A fake run behind the control plane over real HTTP, and a client of it."""
    from archipelago.api.app import create_app
    from tests.http_server import serving

    run = FakeRun()
    with serving(create_app(run, token)) as url, httpx.Client(base_url=url, timeout=10) as client:
        yield client, run
