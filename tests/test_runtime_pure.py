"""The runtime's logic that needs no Ray cluster: Ray's calls are recorded or made to fail
the way a cluster's do, so these run in the fast set (`-m "not ray"`)."""

from __future__ import annotations

import importlib
import os

import pytest

from archipelago.workers.runtime import island_actor

# the module (`ray.util.placement_group` as an attribute is the function of that name)
placement_groups = importlib.import_module("ray.util.placement_group")


def test_an_island_watch_outlives_an_unreadable_name_table_and_releases_once_the_name_is_gone(monkeypatch):
    """Ray's GCS away (a head restarting under GCS fault tolerance): reading the actor names
    raises. That says nothing of the coordinator, so the watch goes on and starts no clock;
    before, the error ended the watch's thread and an island that outlived the outage was
    never released. Once the table answers and the name is gone for `orphan_after_s`, the
    island's placement group is removed and its process ends."""
    answers = iter([True, RuntimeError("GCS unavailable"), RuntimeError("GCS unavailable"), True, False, False, False])
    released: list[str] = []

    def names(coordinator: str, namespace: str) -> bool:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    class Ended(Exception):
        pass

    def end(code: int) -> None:
        raise Ended(code)

    monkeypatch.setattr(island_actor, "_named_actor_exists", names)
    monkeypatch.setattr(placement_groups, "get_placement_group", lambda name: name)
    monkeypatch.setattr(placement_groups, "remove_placement_group", released.append)
    monkeypatch.setattr(os, "_exit", end)
    now = [0.0]  # a clock that moves only while the watch sleeps between reads
    monkeypatch.setattr(island_actor.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(island_actor.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    with pytest.raises(Ended):
        island_actor._orphan_watch("coordinator", "ns", "island-group", orphan_after_s=2.0, poll_s=1.0)
    assert released == ["island-group"]
    assert next(answers, "all read") == "all read"  # released at the third answer of "gone", not before


def test_a_counter_is_fed_its_growth_and_counted_afresh_when_the_run_restarts_its_count():
    """Ray's counters only grow: each record feeds the growth since the last one. The main
    phase counts its rounds from 0 after a warm start's 4: the counter then grows by the
    new count, never by a negative step (which Ray refuses) or by nothing until the old
    count is passed (the series stood still for four rounds). `inc` recorded: no Ray."""
    from ray.util.metrics import Counter

    from archipelago.orchestrator.engine.state.views import RUN_METRICS
    from archipelago.orchestrator.runtime.metrics import RayMetrics

    class Recorded(Counter):
        def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
            self.fed = [*getattr(self, "fed", []), (value, tags)]

    (rounds,) = [m for m in RUN_METRICS if m.key == "round"]
    counter = Recorded(rounds.name, rounds.help, tag_keys=("run_id",))
    metrics = RayMetrics.__new__(RayMetrics)  # its instruments are not needed: `_set` is given one
    metrics.run_id, metrics._counted = "r", {}
    for value in (1, 2, 4, 4, 1, 2, 3, 5):  # a warm start's 4 rounds, then the main phase's 1, 2, ...
        metrics._set(rounds, counter, value, None)
    assert [v for v, _ in counter.fed] == [1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 2.0]
    assert {t["run_id"] for _, t in counter.fed} == {"r"}
    assert sum(v for v, _ in counter.fed) == 4 + 5  # both phases' rounds, once each
