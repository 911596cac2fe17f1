"""The control plane's view of a run over Ray (`api/handle.py`'s `RunHandle`): the run's
coordinator actor, called by name. It lives with the runtime, which knows the actors' names,
and is handed to the API by whoever serves it (the driver's control plane, `archipelago
serve`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from archipelago.api.handle import HandleError

from ..engine.commands import Answer, Command
from ..engine.state.views import EventRecord
from .names import NAMESPACE, coordinator_name, run_id_of_coordinator


def find_run(run_id: str | None = None) -> str:
    """The id of the run to serve: the one given, or the only running one."""
    import ray

    runs = [
        run
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == NAMESPACE and (run := run_id_of_coordinator(a["name"])) is not None
    ]
    if run_id is not None:
        if run_id not in runs:
            raise LookupError(f"no running job with id {run_id!r} (running: {runs or 'none'})")
        return run_id
    if len(runs) != 1:
        raise LookupError(f"found {len(runs)} running jobs ({runs}); pass --run-id")
    return runs[0]


RESTARTING = "the coordinator is starting or restarting; retry in a few seconds"
UNKNOWN = (
    "the coordinator did not answer ({why}): the command may or may not have been applied. Check GET /v1/run "
    "and /v1/events, or send it again with the same Idempotency-Key header, which applies it at most once"
)


class Restarting(Exception):
    """The coordinator did not answer: Ray is restarting it."""


class RayRunHandle:
    """Calls the coordinator actor `archipelago-<run_id>-coordinator`.

    While Ray restarts a coordinator that died (seconds), reads answer with the last answer
    seen (the status says `"coordinator": "restarting"`; cursor reads return nothing new).
    A mutation not answered in time (the coordinator restarting, or busy: the command may
    be waiting for the inbox's lock) is answered 409 saying its outcome is unknown — not
    "nothing was changed", which a retried `AddIslands` then made false — with the way to
    find out or retry safely (an idempotency key). The API never answers 5xx for a fault
    the run is built to survive."""

    def __init__(self, run_id: str, timeout_s: float = 10.0) -> None:
        import ray

        self.ray = ray
        self.actor = ray.get_actor(coordinator_name(run_id), namespace=NAMESPACE)
        self.timeout_s = timeout_s
        self.last: dict[str, Any] = {}  # method -> its last answer, for reads during a restart

    def _call(self, call: Callable[[], Any]) -> Any:
        """`ray.get` of the coordinator call `call` makes. A coordinator that raised is a
        fault of ours (500, its last line); one restarting is `Restarting`."""
        ray = self.ray
        try:
            return ray.get(call(), timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as err:
            raise HandleError(500, str(err).splitlines()[-1]) from err
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
            raise Restarting(type(err).__name__) from err

    def _latest(self, key: str, call: Callable[[], Any]) -> Any:
        """A read that, during a restart, answers with the last answer seen."""
        try:
            self.last[key] = self._call(call)
        except Restarting:
            if key not in self.last:
                raise HandleError(409, RESTARTING) from None
        return self.last[key]

    def _since(self, call: Callable[[], Any]) -> list[Any]:
        """A cursor read: nothing new during a restart (the reader asks again)."""
        try:
            return self._call(call)
        except Restarting:
            return []

    def status(self) -> dict[str, Any]:
        try:
            self.last["status"] = {**self._call(self.actor.status.remote), "coordinator": "running"}
        except Restarting:
            if "status" not in self.last:
                raise HandleError(409, RESTARTING) from None
            return {**self.last["status"], "coordinator": "restarting"}
        return self.last["status"]

    def islands(self) -> dict[str, dict[str, Any]]:
        return self._latest("islands", self.actor.islands.remote)

    def events(self, since: int, limit: int) -> list[EventRecord]:
        return self._since(lambda: self.actor.events_since.remote(since, limit))

    def history(self, since: int, limit: int) -> list[dict[str, Any]]:
        return self._since(lambda: self.actor.history.remote(since, limit))

    def submit(self, command: Command, key: str | None = None) -> Answer:
        try:
            return self._call(lambda: self.actor.submit.remote(command, key))
        except Restarting as err:
            raise HandleError(409, UNKNOWN.format(why=err)) from err
