"""The control plane's view of a run: a small protocol, views out and commands in. Over
Ray it is `orchestrator/runtime/run_handle.py`'s (the coordinator actor called by name),
handed in by whoever serves the API; the API knows no Ray, actor or name (so the API and the
runtime do not import each other both ways). Tests of pure API behaviour use an in-process
implementation of the same protocol."""

from __future__ import annotations

from typing import Any, Protocol

from archipelago.orchestrator.engine.commands import Answer, Command
from archipelago.orchestrator.engine.state.views import EventRecord


class HandleError(Exception):
    """A request the handle could not put to the run; `status` is the HTTP status the API
    answers with (a run's own refusals come back as `Refused`, not as this)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class RunHandle(Protocol):
    """Views out (status, islands, events, history), commands in (`submit`)."""

    def status(self) -> dict[str, Any]: ...
    def islands(self) -> dict[str, dict[str, Any]]: ...
    def events(self, since: int, limit: int) -> list[EventRecord]: ...
    def history(self, since: int, limit: int) -> list[dict[str, Any]]: ...
    def submit(self, command: Command, key: str | None = None) -> Answer:
        """`key`: the client's idempotency key (a key accepted before gets its first answer)."""
