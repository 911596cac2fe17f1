"""Shared fixtures: one local Ray instance per test session, started only when needed."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance per test module (modules with their own cluster need Ray down)."""
    import ray

    ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory):
    """A private corpus cache, so tests never depend on (or disturb) the user's cache."""
    path = tmp_path_factory.mktemp("corpus-cache")
    from workers.corpus import prepare_stdlib_corpus

    prepare_stdlib_corpus(path)
    return str(path)
