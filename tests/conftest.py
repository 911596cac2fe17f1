"""Shared fixtures and guard rails.

- One local Ray instance per test module, started only when a test asks for it.
- Per-test time limits (pytest-timeout): `timeout` in pyproject for unit tests, a longer one
  for tests marked `ray`, so a hung Ray test fails in minutes instead of hanging CI.
- A test that starts Ray must be marked `ray`: `-m "not ray"` is the contributors' fast loop
  and must stay free of Ray (checked after every unmarked test).
- The suite's wall time is printed at the end.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RAY_TEST_TIMEOUT_S = 600
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
_STARTED = time.monotonic()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("ray") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(RAY_TEST_TIMEOUT_S))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    yield
    ray = sys.modules.get("ray")
    if ray is not None and not item.get_closest_marker("ray") and ray.is_initialized():
        pytest.fail(f"{item.nodeid} started Ray but is not marked `ray` (the `-m 'not ray'` loop must stay Ray-free)")


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(f"suite wall time: {time.monotonic() - _STARTED:.1f} s")


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance per test module (modules with their own cluster need Ray down)."""
    import ray

    ray.shutdown()
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory):
    """A private corpus cache, so tests never depend on (or disturb) the user's cache."""
    path = tmp_path_factory.mktemp("corpus-cache")
    from workers.corpus import prepare_stdlib_corpus

    prepare_stdlib_corpus(path)
    return str(path)
