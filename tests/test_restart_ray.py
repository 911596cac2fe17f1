"""Coordinator restarts and resumes on a real local Ray instance."""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import pytest
import ray

from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.commands import Ack, Stop
from archipelago.orchestrator.runtime.driver import run
from archipelago.orchestrator.runtime.names import NAMESPACE
from tests.helpers import run_until_records, toy_quadratic

pytestmark = pytest.mark.ray


def _cfg(tmp_path, *extra):
    return load_config(
        None,
        toy_quadratic(3, 0.05, "inner_steps=3", "checkpoint.every_rounds=1", f"out_dir={tmp_path / 'out'}", *extra),
    )


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# streaming with τ: islands answer mid-segment and train on (`order_steps.py`) while the coordinator dies
STREAMING = ("task.kwargs.split=true", "mode=streaming", "mode.fragments=2", "mode.tau=1", "inner_steps=4")


@pytest.mark.parametrize(("mode", "steps_a_round"), [((), 1), (STREAMING, 2)], ids=["diloco", "streaming_tau"])
def test_killed_coordinator_restarts_from_checkpoint_and_reattaches_islands(ray_local, tmp_path, mode, steps_a_round):
    cfg = _cfg(tmp_path, "rounds=10", *mode)
    driver_log, messages = logging.getLogger("archipelago.orchestrator.runtime.driver"), _Messages()
    driver_log.addHandler(messages)  # on the logger itself: whatever the CLI tests configured before
    driver_log.setLevel(logging.WARNING)
    try:  # the level and handler restored even when the run fails (the next test's logging is its own)
        thread, box = run_until_records(cfg, "killtest", 3, timeout_s=60)
        ray.kill(ray.get_actor("archipelago-killtest-coordinator", namespace=NAMESPACE), no_restart=False)
        thread.join(timeout=120)
    finally:
        driver_log.removeHandler(messages)
        driver_log.setLevel(logging.NOTSET)
    metrics = tmp_path / "out" / "metrics.jsonl"
    summary = box["summary"]
    assert summary["outer_steps"] == 10 * steps_a_round  # streaming: one outer step per fragment
    assert [r["round"] for r in _records(metrics)] == list(range(1, 11))  # no lost or doubled version
    assert [r["version"] for r in _records(metrics)] == [steps_a_round * r for r in range(1, 11)]
    events = _records(tmp_path / "out" / "events.jsonl")
    kinds = [e["kind"] for e in events]
    assert kinds.count("restart") == 1 and kinds.count("reattach") == 3
    restart = next(e for e in events if e["kind"] == "restart")
    assert restart["rounds_done"] >= 2
    assert sum("coordinator died" in m for m in messages.messages) == 1
    assert all(s["state"] == "training" for s in summary["islands"].values())
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if "killtest-island" in a["name"]]


def _islands(run_id: str, count: int) -> list[dict]:
    """Each island's identity, asked in its `control` group (answered beside a round)."""
    actors = [ray.get_actor(f"archipelago-{run_id}-island-{i}", namespace=NAMESPACE) for i in range(count)]
    return ray.get([a.identity.remote() for a in actors], timeout=10)


def _wait_busy(run_id: str, count: int, steps_past: int, timeout_s: float = 120.0) -> list[dict]:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            seen = _islands(run_id, count)
            if all(s["busy"] and s["inner_steps_done"] >= steps_past for s in seen):
                return seen
        except (ValueError, ray.exceptions.RayError):
            pass  # not placed yet
        time.sleep(0.2)
    raise AssertionError(f"the islands of {run_id} were not all {steps_past} steps into a round")


def _events_after_restart(path, kind: str, count: int, timeout_s: float = 60.0) -> list[dict]:
    """The first `count` events of `kind` after the newest restart, once they are written."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        events = _records(path) if path.exists() else []
        restarts = [i for i, e in enumerate(events) if e["kind"] == "restart"]
        found = [e for e in events[restarts[-1] :] if e["kind"] == kind] if restarts else []
        if len(found) >= count:
            return found[:count]
        time.sleep(0.1)
    raise AssertionError(f"no {count} {kind} events after a restart within {timeout_s:g}s")


def test_a_coordinator_killed_mid_round_keeps_every_busy_island_and_its_state(ray_local, tmp_path):
    """Rounds of 60 s (120 steps of 0.5 s), the coordinator's process SIGKILLed mid-round. Before: the restarted
    coordinator's `describe` waited behind each island's round in flight; after 30 s it
    killed the island and placed a new one (a fresh inner optimizer), one after another."""
    out = f"out_dir={tmp_path / 'out'}"
    common = ("inner.optimizer=adamw", "checkpoint.every_rounds=1", "elastic.placement_timeout_s=60", out)
    # a first round of 2 steps leaves the checkpoint a restart resumes from ...
    run(
        load_config(None, toy_quadratic(2, 0.5, "inner_steps=2", "rounds=1", *common)),
        show_progress=False,
        run_id="busy",
    )
    # ... then the run goes on with rounds of 120 inner steps of 0.5 s
    cfg = load_config(None, toy_quadratic(2, 0.5, "inner_steps=120", "rounds=2", *common))
    thread, box = run_until_records(cfg, "busy", 1, timeout_s=5)
    before = _wait_busy("busy", 2, steps_past=5)
    coordinator = ray.get_actor("archipelago-busy-coordinator", namespace=NAMESPACE)
    pid = ray.get(coordinator.__ray_call__.remote(lambda _self: os.getpid()))  # answered beside its run()
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    # the new coordinator takes every island over within seconds (not 30 s an island behind
    # its round); each gives up the dead coordinator's round at its next 0.5 s step
    reattached = _events_after_restart(tmp_path / "out" / "events.jsonl", "reattach", 2)
    assert max(e["time"] for e in reattached) - killed < 30
    now = max(s["inner_steps_done"] for s in _islands("busy", 2))
    after = _wait_busy("busy", 2, steps_past=now + 2, timeout_s=60)  # the new coordinator's round
    for b, a in zip(before, after):
        assert a["pid"] == b["pid"]  # the same process: kept, not replaced
        assert a["inner_steps_done"] > b["inner_steps_done"] and a["optimizer_state"] == b["optimizer_state"] > 0
    # the rest of the round would add a minute and prove nothing more: stop now
    coordinator = ray.get_actor("archipelago-busy-coordinator", namespace=NAMESPACE)
    assert ray.get(coordinator.submit.remote(Stop(now=True))) == Ack(detail={"action": "stop", "now": True})
    thread.join(timeout=120)
    summary = box["summary"]
    assert summary["state"] == "stopped" and summary["outer_steps"] == 1
    events = _records(tmp_path / "out" / "events.jsonl")
    restart = max(i for i, e in enumerate(events) if e["kind"] == "restart")
    later = [e["kind"] for e in events[restart:]]
    assert later.count("reattach") == 2 and "requested" not in later and "crash" not in later


def test_a_result_lost_with_its_owner_is_that_islands_failure_not_the_runs(ray_local, tmp_path):
    """Before: only `RayActorError` and `RayTaskError` were caught fetching a result; an
    `OwnerDiedError` (an `ObjectLostError`) between `ray.wait` and `ray.get` ended the run."""
    import numpy as np

    from archipelago.orchestrator.engine.pool import Failed
    from archipelago.orchestrator.runtime.island_pool import RayIslandPool

    @ray.remote(num_cpus=0)
    class Owner:
        def hold(self) -> list:
            return [ray.put(np.zeros(1_000_000))]  # nested, in the object store, owned by this actor

        def pid(self) -> int:
            return os.getpid()

    owner = Owner.remote()
    (ref,) = ray.get(owner.hold.remote())
    os.kill(ray.get(owner.pid.remote()), signal.SIGKILL)  # the owner's process dies, its objects with it
    time.sleep(2)
    pool = RayIslandPool(_cfg(tmp_path), "lost")
    event = pool._fetch(ref, 7, 2)
    assert event == Failed(ticket=7, island=2, reason="result lost: OwnerDiedError")
    junk = pool._fetch(ray.put("not a result"), 8, 2)
    assert junk == Failed(ticket=8, island=2, reason="sent a str, not a round result")
