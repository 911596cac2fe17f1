"""`/metrics` by the book, on what a real run produces (a crash, a join, a drain, a late
island): it parses with `prometheus_client`'s own parser; every `_total` is a counter and
every counter is a `_total`, no gauge is named for a count, `archipelago_build_info` names
the version and commit; round time and update staleness are histograms whose counts
are the run's; island series carry `run_id` and `island` only, and the state set has a
series per state, so no series changes a label value while it lives."""

from __future__ import annotations

import re
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from archipelago.api.prometheus import BUILD_INFO, render
from archipelago.orchestrator import build_info
from archipelago.orchestrator.bench.simulation.pool import Fault, FaultKind
from archipelago.orchestrator.engine.commands import AddIslands, Drain
from archipelago.orchestrator.engine.state.views import (
    HISTOGRAMS,
    ISLAND_METRICS,
    ISLAND_STATE,
    RUN_METRICS,
    RoundRecord,
    RunStatus,
)
from archipelago.orchestrator.engine.types import IslandState
from tests.engine_scenarios import drive, scenario_cfg
from tests.helpers import in_process_engine


def _scrapes(tmp_path) -> tuple[list[Any], list[dict[str, Any]], Any]:
    cfg = scenario_cfg(tmp_path, "async")
    faults = [Fault(FaultKind.CRASH, 1, order=2), Fault(FaultKind.LATE, 2, order=3, seconds=30.0)]
    engine, _ = in_process_engine(cfg, faults, join_s=2.0)
    scrapes: list[Any] = []
    records: list[dict[str, Any]] = []

    def scrape(status: RunStatus, islands: dict[str, dict[str, Any]], record: RoundRecord) -> None:
        records.append(record.as_dict())
        scrapes.append(list(text_string_to_metric_families(render(status.as_dict(), islands).decode())))

    engine.outputs.on_record = scrape
    drive(engine, at={2: lambda e: e.submit(AddIslands(count=1)), 4: lambda e: e.submit(Drain(island=0))})
    return scrapes, records, engine


def test_metrics_parse_with_counters_histograms_and_stable_labels(tmp_path):
    scrapes, records, engine = _scrapes(tmp_path)
    kinds = {m.name.removesuffix("_total"): m.kind.value for m in RUN_METRICS + ISLAND_METRICS + HISTOGRAMS}
    for families in scrapes:
        assert {f.name for f in families} == {*kinds, ISLAND_STATE.name, BUILD_INFO}
        for family in families:
            assert family.type == kinds.get(family.name, "gauge")
            for sample in family.samples:
                assert sample.name.endswith("_total") == (family.type == "counter"), sample.name
            if family.type == "gauge":  # no gauge named for a count; a unit where there is one
                assert not re.search(r"(?<!_per)_(count|round|rounds|steps)$", family.name), family.name
    (info,) = {f.name: f for f in scrapes[-1]}[BUILD_INFO].samples  # Prometheus' `_info` idiom: 1, labelled
    assert info.value == 1 and info.labels == {"version": build_info.version(), "commit": build_info.commit()}
    last = {f.name: f for f in scrapes[-1]}
    round_time = {s.name: s for s in last["archipelago_round_duration_seconds"].samples if "le" not in s.labels}
    assert round_time["archipelago_round_duration_seconds_count"].value == len(records)
    assert round_time["archipelago_round_duration_seconds_sum"].value == sum(r["round_seconds"] for r in records)
    staleness = [r for record in records for r in record["staleness_updates"]]
    buckets = {
        s.labels["le"]: s.value for s in last["archipelago_update_staleness_versions"].samples if "le" in s.labels
    }
    assert buckets["+Inf"] == len(staleness) and buckets["0.5"] == staleness.count(0) < len(staleness)
    # an island's series are labelled by the island alone (nothing that changes while it
    # lives: no state, no node); its state is the state set's, a series per state always
    states: dict[str, set[str]] = {}
    for families in scrapes:
        for family in families:
            by_island: dict[str, list[Any]] = {}
            for sample in family.samples:
                if family.name == BUILD_INFO:
                    continue
                if "island" not in sample.labels:
                    assert set(sample.labels) <= {"run_id", "le"}
                elif family.name == ISLAND_STATE.name:
                    by_island.setdefault(sample.labels["island"], []).append(sample)
                else:
                    assert set(sample.labels) == {"run_id", "island"}, sample
            for island, samples in by_island.items():
                assert sorted(x.labels["state"] for x in samples) == sorted(x.value for x in IslandState)
                assert sum(x.value for x in samples) == 1
                states.setdefault(island, set()).update(x.labels["state"] for x in samples if x.value == 1)
    assert any({"training", "late"} <= seen for seen in states.values())  # one series, two states
    assert all(s.labels.get("island") not in ("0", "1") for f in scrapes[-1] for s in f.samples)  # drained, dead
    assert engine.summary["rounds_done"] == len(records)
