"""The control plane's view of a run over Ray (`api/handle.py`'s `RunHandle`): the run's
coordinator actor, called by name. It lives with the runtime, which knows the actors' names,
and is handed to the API by whoever serves it (the driver's control plane, `archipelago
serve`)."""

from __future__ import annotations

import threading
from typing import Any

from archipelago.api.handle import HandleError

from ..engine.commands import Answer, Command
from ..engine.state.views import CoordinatorState, EventRecord
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
READ_S = 1.0  # a read's wait for the coordinator: the control plane answers a read within 2 s


class Unanswered(Exception):
    """The coordinator did not answer: Ray is restarting it, or it was slow."""

    def __init__(self, state: CoordinatorState) -> None:
        super().__init__(state.value)
        self.state = state


class RayRunHandle:
    """Calls the coordinator actor `archipelago-<run_id>-coordinator`.

    A read waits `READ_S` at most, so the control plane answers a read within 2 s whatever
    the coordinator is doing: an actor still starting (its process and imports take seconds
    on a loaded node, and the control plane serves from the run's first moment), Ray
    restarting one that died, or a host too loaded to schedule it. Unanswered, a read
    answers with the last answer seen (the status says `"coordinator": "restarting"` or
    `"slow"`; cursor reads return nothing new), or 409 "retry" where none was seen yet.
    A mutation not answered in `timeout_s` (the coordinator restarting, or busy: the command
    may be waiting for the inbox's lock) is answered 409 saying its outcome is unknown — not
    "nothing was changed", which a retried `AddIslands` then made false — with the way to
    find out or retry safely (an idempotency key). The API never answers 5xx for a fault
    the run is built to survive."""

    def __init__(self, run_id: str, timeout_s: float = 10.0, read_s: float = READ_S) -> None:
        import ray

        self.ray = ray
        self.actor = ray.get_actor(coordinator_name(run_id), namespace=NAMESPACE)
        self.timeout_s, self.read_s = timeout_s, read_s
        self.last: dict[str, Any] = {}  # method -> its last answer, for reads the coordinator did not answer
        # method -> (its arguments, its call still unanswered): a read asked again while the
        # coordinator is slow waits on that call rather than queueing another on its threads
        # (a 1-Hz poller of a frozen coordinator would otherwise pile calls up, and a command
        # would wait behind them)
        self.pending: dict[str, tuple[tuple[Any, ...], Any]] = {}
        self.lock = threading.Lock()

    def _get(self, ref: Any, timeout_s: float) -> Any:
        """`ray.get` of a coordinator call. A coordinator that raised is a fault of ours (500,
        its last line); one that did not answer is `Unanswered`."""
        ray = self.ray
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.RayTaskError as err:
            raise HandleError(500, str(err).splitlines()[-1]) from err
        except ray.exceptions.RayActorError as err:
            raise Unanswered(CoordinatorState.RESTARTING) from err
        except ray.exceptions.GetTimeoutError as err:
            raise Unanswered(CoordinatorState.SLOW) from err

    def _read(self, method: str, *args: Any) -> Any:
        """The coordinator's `method(*args)`, waiting `read_s` at most: the same read still
        unanswered is waited on again, not called again."""
        with self.lock:
            asked, ref = self.pending.pop(method, ((), None))
            if ref is None or asked != args:
                ref = getattr(self.actor, method).remote(*args)
        try:
            return self._get(ref, self.read_s)
        except Unanswered as err:
            if err.state == CoordinatorState.SLOW:
                with self.lock:
                    self.pending[method] = (args, ref)
            raise

    def _latest(self, method: str, *args: Any) -> Any:
        """A read that, unanswered, answers with the last answer seen."""
        try:
            self.last[method] = self._read(method, *args)
        except Unanswered:
            if method not in self.last:
                raise HandleError(409, RESTARTING) from None
        return self.last[method]

    def _since(self, method: str, *args: Any) -> list[Any]:
        """A cursor read: nothing new while unanswered (the reader asks again)."""
        try:
            return list(self._read(method, *args))
        except Unanswered:
            return []

    def status(self) -> dict[str, Any]:
        try:
            self.last["status"] = {**self._read("status"), "coordinator": CoordinatorState.RUNNING.value}
        except Unanswered as err:
            if "status" not in self.last:
                raise HandleError(409, RESTARTING) from None
            return {**self.last["status"], "coordinator": err.state.value}
        return self.last["status"]

    def islands(self) -> dict[str, dict[str, Any]]:
        return dict(self._latest("islands"))

    def events(self, since: int, limit: int) -> list[EventRecord]:
        return self._since("events_since", since, limit)

    def history(self, since: int, limit: int) -> list[dict[str, Any]]:
        return self._since("history", since, limit)

    def submit(self, command: Command, key: str | None = None) -> Answer:
        try:
            return self._get(self.actor.submit.remote(command, key), self.timeout_s)
        except Unanswered as err:
            raise HandleError(409, UNKNOWN.format(why=err)) from err
