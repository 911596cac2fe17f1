"""Shared fixtures and guard rails.

- Two processes by default (pytest-xdist, `-n 2` in pyproject), each test in its turn: which
  test runs beside which is `tests/ray_apart.py`.
- One local Ray instance per worker shared across modules, started only when a test asks for it.
- Per-test time limits (pytest-timeout): `timeout` in pyproject for unit tests, a longer one
  for tests marked `ray`, so a hung Ray test fails in minutes instead of hanging CI.
- A test that starts Ray must be marked `ray`: `-m "not ray"` is the contributors' fast loop
  and must stay free of Ray (checked after every unmarked test).
- Ray tests of other mechanisms run without the preflight plan, as `preflight: false` runs:
  it measures each distinct model once (seconds apiece, most of them a fresh interpreter),
  and the suite runs dozens of distinct toy configs. Its own tests are marked `preflight`.
- The suite's wall time is printed at the end.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests import ray_apart

REPO = Path(__file__).resolve().parents[1]
RAY_TEST_TIMEOUT_S = 600
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
_STARTED = time.monotonic()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    no_cuda = pytest.mark.skip(reason="no CUDA device here (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("ray") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(RAY_TEST_TIMEOUT_S))
        if item.get_closest_marker("cuda") and not torch.cuda.is_available():
            item.add_marker(no_cuda)
    items.sort(key=ray_apart.turn_of_item)  # stable: each turn keeps the files' order
    ray_apart.check_against_markers(config.rootpath, items)


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Which test runs beside which (`tests/ray_apart.py`)."""
    return ray_apart.make_scheduler(config, log)


_TURNS: list[ray_apart.Turns] = []  # this worker's, made at its first test


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Wait for the test's turn (`tests/ray_apart.py`) before any of its fixtures is set up:
    a module's own Ray instance is a module-scoped fixture. The lock is a file in the folder
    that holds each worker's own temporary folder (xdist's `_tmp_path_factory`, as xdist itself
    reads it); none when the suite runs in one process."""
    if not _TURNS:
        shared = os.environ.get("PYTEST_XDIST_WORKER") is not None
        folder = item.config._tmp_path_factory.getbasetemp().parent
        _TURNS.append(ray_apart.Turns(folder / "ray-turns.lock" if shared else None))
    _TURNS[0].take(ray_apart.turn_of_item(item), shut_shared=_shut_shared_ray)


def _shut_shared_ray() -> None:
    """This worker's `ray_local` instance shut down, where it is up."""
    if _ray_up() and sys.modules["ray"].get_runtime_context().gcs_address == _SHARED_RAY.get("address"):
        sys.modules["ray"].shutdown()


def _ray_up() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    before = _ray_up()
    yield
    if not before and not item.get_closest_marker("ray") and _ray_up():
        pytest.fail(f"{item.nodeid} started Ray but is not marked `ray` (the `-m 'not ray'` loop must stay Ray-free)")


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(f"suite wall time: {time.monotonic() - _STARTED:.1f} s")


@pytest.fixture(autouse=True)
def _preflight_only_where_tested(request, monkeypatch):
    if request.node.get_closest_marker("ray") and not request.node.get_closest_marker("preflight"):
        # the run goes on as if its plan had fitted and had no codec to choose (`Plan.config`)
        monkeypatch.setattr(
            "archipelago.orchestrator.runtime.driver.preflight",
            lambda cfg, *, on_ray_cluster: types.SimpleNamespace(config=lambda cfg: cfg),
        )


_SHARED_RAY: dict[str, str] = {}  # the GCS address of the local instance `ray_local` started


@pytest.fixture
def ray_local(request):
    """One local Ray instance per worker, shared by the tests that ask for it, across modules
    (starting Ray costs seconds each time). A module with its own cluster shuts Ray down
    first; the next test that asks for this one starts it again. Shut down at the worker's
    first test without Ray (`pytest_runtest_setup`), or at the end of the session.

    After each test, any run it left on the instance is ended (`_end_leftover_runs`): a
    test that fails mid-run would otherwise leave its coordinator and islands holding the
    instance's CPUs, and every Ray test after it waits for placements until its timeout
    (seen once: a failed chaos test's run starved the next test for its whole 600 s)."""
    if not request.node.get_closest_marker("ray"):
        pytest.fail(f"{request.node.nodeid} asks for `ray_local` but is not marked `ray`")
    import ray

    ours = ray.is_initialized() and ray.get_runtime_context().gcs_address == _SHARED_RAY.get("address")
    if not ours:
        ray.shutdown()
        for attempt in (1, 2):
            try:
                with importable_checkout():
                    ray.init(
                        address="local",  # never join a cluster that another process (`ray start`, a run) left here
                        num_cpus=4,
                        include_dashboard=False,
                        log_to_driver=False,
                    )
                break
            except Exception as err:  # Ray's own: its raylet not registered within 30 s (fixed in Ray)
                if attempt == 2 or "timed out during startup" not in str(err):
                    raise
                ray.shutdown()  # once more: on 2 loaded cores a start once took longer than Ray waits
        _SHARED_RAY["address"] = ray.get_runtime_context().gcs_address
    yield ray
    _end_leftover_runs(ray)


def _end_leftover_runs(ray) -> None:
    """Kill every run actor (coordinators, islands, slices) still named on the shared
    instance, and remove its placement groups."""
    from archipelago.orchestrator.runtime.names import NAMESPACE

    if not ray.is_initialized() or ray.get_runtime_context().gcs_address != _SHARED_RAY.get("address"):
        return  # the test shut the shared instance down, or replaced it: nothing of it is left
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == NAMESPACE:
            with contextlib.suppress(ValueError):  # gone meanwhile
                ray.kill(ray.get_actor(actor["name"], namespace=NAMESPACE), no_restart=True)
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    for pg_id, info in ray.util.placement_group_table().items():  # islands of several workers hold bundles
        if info["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))


@contextmanager
def importable_checkout() -> Iterator[None]:
    """This checkout on PYTHONPATH while a Ray instance starts, so its workers import the
    tests' task factories (`tests.toy_tasks`). Through the environment Ray's processes
    inherit, as `archipelago run` does, not a runtime env: the workers Ray starts ahead have
    none, so every actor of a run with one waited for a fresh worker (measured: a warm
    instance's 3-island run 6.6 -> 5.7 s, its first run 11.6 -> 5.4 s)."""
    from archipelago.orchestrator.runtime.driver import on_pythonpath

    with on_pythonpath(str(REPO)):
        yield


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _ray_up():
        sys.modules["ray"].shutdown()
    if (helpers := sys.modules.get("tests.helpers")) is not None:
        helpers.remove_scratch()  # before `os._exit` below skips its removal at exit
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave with the session's status once everything is reported, skipping interpreter
    teardown when Ray was loaded: after the dozens of Ray sessions one suite starts and
    stops in this process, Ray's core worker can crash while Python finalises (a segfault,
    exit 139, after every test had passed: ray-project/ray#31145, state of earlier sessions
    still referenced from C++). The test results are unaffected; only that teardown is."""
    if "ray" in sys.modules and _EXIT_STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[0])


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory):
    """A private corpus cache, so tests never depend on (or disturb) the user's cache."""
    path = tmp_path_factory.mktemp("corpus-cache")
    from archipelago.workers.data.corpus import prepare_stdlib_corpus

    prepare_stdlib_corpus(path)
    return str(path)


@pytest.fixture
def api():
    """A fake run behind the control plane over real HTTP, as (client, run); the
    token is `tests.fake_handle.TOKEN`."""
    from tests.fake_handle import served

    with served() as client_and_run:
        yield client_and_run
