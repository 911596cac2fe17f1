"""Robust aggregation: norm outliers, quarantine streaks; and a NaN island on real Ray."""

from __future__ import annotations

import json

import numpy as np
import pytest

from orchestrator.algorithms.robust import NormGuard
from orchestrator.config import RobustConfig
from orchestrator.config_load import load_config
from orchestrator.engine.admission import Admission, ExactVersion, Verdict
from orchestrator.engine.types import Decision, Reason
from orchestrator.runtime.driver import run


def test_norm_guard_rejects_outliers_after_history():
    guard = NormGuard(RobustConfig(norm_ratio=10, min_history=3))
    for scale in (1.0, 1.2, 0.9):
        norm = float(np.linalg.norm(np.full(4, scale / 2)))
        assert guard.check_norm(norm) is None
        guard.accept(norm)
    assert guard.check_norm(100.0) is not None  # > 10 x the median 1.0
    assert guard.check_norm(4.0) is None


def test_quarantine_needs_consecutive_fault_rejections():
    a = Admission(2, None, ExactVersion(), quarantine_after=2)
    bad, good = Verdict(Decision.REJECT, Reason.NON_FINITE), Verdict(Decision.ACCEPT)
    stale = Verdict(Decision.REJECT, Reason.STALE)
    assert not a.record(0, bad)
    assert not a.record(0, good)
    assert not a.record(0, bad)
    assert not a.record(1, stale) and not a.record(1, stale)  # staleness is the pacing's business, not a fault
    assert a.record(0, bad) and a.quarantined == {0}


@pytest.mark.ray
def test_nan_island_is_rejected_then_quarantined_and_the_model_stays_finite(ray_local, tmp_path):
    cfg = load_config(
        None,
        [
            "task.factory=tests.toy_tasks:make_quadratic",
            "task.kwargs.centers=[[1.0,0.0],[-0.5,2.0],[0.5,0.5]]",
            "task.kwargs.nan_island=2",
            "islands.count=3",
            "inner.optimizer=sgd",
            "inner.lr=0.1",
            "inner.warmup_steps=0",
            "inner.grad_clip=null",
            "rounds=4",
            "inner_steps=3",
            "robust.quarantine_after=2",
            "elastic.replace_dead=false",
            "data_shards=3",
            f"task.kwargs.fault_dir={tmp_path}",
            f"out_dir={tmp_path / 'out'}",
        ],
    )
    summary = run(cfg, show_progress=False)
    isl = summary["islands"]
    assert isl["2"]["state"] == "quarantined" and isl["2"]["rejections"] == 2
    assert isl["0"]["rounds_contributed"] == isl["1"]["rounds_contributed"] == 4
    assert np.isfinite(summary["final_eval_loss"])
    events = [json.loads(line) for line in (tmp_path / "out" / "events.jsonl").read_text().splitlines()]
    kinds = [(e["kind"], e["island"]) for e in events]
    assert kinds.count(("rejection", 2)) == 2 and ("quarantined", 2) in kinds
    assert all("non-finite" in e["reason"] for e in events if e["kind"] == "rejection")
    assert sum(k == "join" for k, _ in kinds) == 3
