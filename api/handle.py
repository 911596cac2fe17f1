"""The control plane's view of a run: a small protocol, implemented over Ray by calling
the coordinator actor of a run by name. The API never touches algorithm internals; tests
of pure API behaviour use an in-process implementation of the same protocol."""

from __future__ import annotations

from typing import Any, Protocol

from orchestrator.engine.types import NAMESPACE, coordinator_name, run_id_of_coordinator


class HandleError(Exception):
    """A request the run refused; `status` is the HTTP status the API answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class RunHandle(Protocol):
    def status(self) -> dict[str, Any]: ...
    def islands(self) -> dict[str, dict[str, Any]]: ...
    def events(self, since: int, limit: int) -> list[dict[str, Any]]: ...
    def history(self, since: int, limit: int) -> list[dict[str, Any]]: ...
    def set_target(self, n: int) -> int: ...
    def add_islands(self, n: int) -> int: ...
    def drain(self, island: int) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def stop(self) -> None: ...
    def update_settings(self, changes: dict[str, Any]) -> dict[str, Any]: ...


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


class Restarting(Exception):
    """The coordinator did not answer: Ray is restarting it."""


class RayRunHandle:
    """Calls the coordinator actor `archipelago-<run_id>-coordinator`.

    While Ray restarts a coordinator that died (seconds), reads answer with the last answer
    seen (the status says `"coordinator": "restarting"`; cursor reads return nothing new)
    and mutations are refused with 409: the client is told to retry, nothing is lost, and
    the API never answers 5xx for a fault the run is built to survive."""

    def __init__(self, run_id: str, timeout_s: float = 10.0) -> None:
        import ray

        self.ray = ray
        self.actor = ray.get_actor(coordinator_name(run_id), namespace=NAMESPACE)
        self.timeout_s = timeout_s
        self.last: dict[str, Any] = {}  # method -> its last answer, for reads during a restart

    def _call(self, method: str, *args: Any) -> Any:
        ray = self.ray
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, KeyError):
                raise HandleError(404, str(cause).strip("'\"")) from err
            if isinstance(cause, ValueError):
                raise HandleError(422, str(cause)) from err
            raise HandleError(500, str(err).splitlines()[-1]) from err
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
            raise Restarting(type(err).__name__) from err

    def _latest(self, method: str) -> Any:
        """A read that, during a restart, answers with the last answer seen."""
        try:
            self.last[method] = self._call(method)
        except Restarting:
            if method not in self.last:
                raise HandleError(409, RESTARTING) from None
        return self.last[method]

    def _since(self, method: str, since: int, limit: int) -> list[dict[str, Any]]:
        """A cursor read: nothing new during a restart (the reader asks again)."""
        try:
            return self._call(method, since, limit)
        except Restarting:
            return []

    def _mutate(self, method: str, *args: Any) -> Any:
        try:
            return self._call(method, *args)
        except Restarting as err:
            raise HandleError(
                409, f"the coordinator is restarting ({err}); nothing was changed: retry in a few seconds"
            ) from err

    def status(self) -> dict[str, Any]:
        try:
            self.last["status"] = {**self._call("status"), "coordinator": "running"}
        except Restarting:
            if "status" not in self.last:
                raise HandleError(409, RESTARTING) from None
            return {**self.last["status"], "coordinator": "restarting"}
        return self.last["status"]

    def islands(self) -> dict[str, dict[str, Any]]:
        return self._latest("islands")

    def events(self, since: int, limit: int) -> list[dict[str, Any]]:
        return self._since("events_since", since, limit)

    def history(self, since: int, limit: int) -> list[dict[str, Any]]:
        return self._since("history", since, limit)

    def set_target(self, n: int) -> int:
        return self._mutate("set_target", n)

    def add_islands(self, n: int) -> int:
        return self._mutate("add_islands", n)

    def drain(self, island: int) -> None:
        self._mutate("drain_island", island)

    def pause(self) -> None:
        self._mutate("pause")

    def resume(self) -> None:
        self._mutate("resume")

    def stop(self) -> None:
        self._mutate("stop")

    def update_settings(self, changes: dict[str, Any]) -> dict[str, Any]:
        return self._mutate("update_settings", changes)
