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


class RayRunHandle:
    """Calls the coordinator actor `archipelago-<run_id>-coordinator`."""

    def __init__(self, run_id: str, timeout_s: float = 10.0) -> None:
        import ray

        self.ray = ray
        self.actor = ray.get_actor(coordinator_name(run_id), namespace=NAMESPACE)
        self.timeout_s = timeout_s

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
            raise HandleError(
                503, f"the coordinator is not answering ({type(err).__name__}); it may be restarting"
            ) from err

    def status(self) -> dict[str, Any]:
        return self._call("status")

    def islands(self) -> dict[str, dict[str, Any]]:
        return self._call("islands")

    def events(self, since: int, limit: int) -> list[dict[str, Any]]:
        return self._call("events_since", since, limit)

    def history(self, since: int, limit: int) -> list[dict[str, Any]]:
        return self._call("history", since, limit)

    def set_target(self, n: int) -> int:
        return self._call("set_target", n)

    def add_islands(self, n: int) -> int:
        return self._call("add_islands", n)

    def drain(self, island: int) -> None:
        self._call("drain_island", island)

    def pause(self) -> None:
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def stop(self) -> None:
        self._call("stop")

    def update_settings(self, changes: dict[str, Any]) -> dict[str, Any]:
        return self._call("update_settings", changes)
